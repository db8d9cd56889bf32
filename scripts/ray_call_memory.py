"""Does a plain Ray actor's own memory grow with the calls it answers? (issue 22's soak: Data
Constructors grow 7-16 % over the 225 s after warm-up while their Python heap stays flat.)

    python scripts/ray_call_memory.py SECONDS CLIENT_THREADS [MAX_CONCURRENCY]

One actor answers step-sized replies (three 512-token int64 fields and a small array, inline in
the reply as a constructor's are) to CLIENT_THREADS driver threads calling as fast as they can;
every 10 s its own memory (private pages of its mappings, Ray's object store excluded, as
`bench soak` counts it) is printed; the last line is JSON with the growth after a quarter of the
run. MALLOC_ARENA_MAX=2, as the service's embedded Ray sets it.
"""
import os, sys, threading, time, json
os.environ.setdefault("MALLOC_ARENA_MAX", "2")
import numpy as np, ray

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 180
THREADS = int(sys.argv[2]) if len(sys.argv) > 2 else 64

@ray.remote
class Echo:
    def __init__(self):
        self.step = {f: np.zeros((1, 512), np.int64) for f in ("tokens", "labels", "position_ids")}
    def pid(self):
        return os.getpid()
    def get(self, step, rank):
        return {"step": step, "rank": rank, "batch": self.step, "info": {"samples": np.zeros((4, 3), np.int64)}}

def own_mib(pid):
    own = 0
    with open(f"/proc/{pid}/smaps") as f:
        path = ""
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "-" in parts[0] and not line.startswith(("Private", "Shared")):
                path = parts[5] if len(parts) > 5 else ""
            elif parts[0] in ("Private_Clean:", "Private_Dirty:") and "plasma" not in path:
                own += int(parts[1])
    return own / 1024

ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
         runtime_env={"env_vars": {"MALLOC_ARENA_MAX": "2"}})
CONC = int(sys.argv[3]) if len(sys.argv) > 3 else 1
actor = Echo.options(max_concurrency=CONC).remote()
pid = ray.get(actor.pid.remote())
stop, calls = threading.Event(), [0] * THREADS
def client(k):
    i = 0
    while not stop.is_set():
        ray.get(actor.get.remote(i, k)); i += 1
    calls[k] = i
threads = [threading.Thread(target=client, args=(k,)) for k in range(THREADS)]
t0 = time.time()
for t in threads: t.start()
samples = []
while time.time() - t0 < SECONDS:
    time.sleep(10)
    samples.append((round(time.time() - t0), round(own_mib(pid), 1)))
    print(samples[-1], flush=True)
stop.set()
for t in threads: t.join()
total = sum(calls)
warm = next(m for s, m in samples if s >= SECONDS / 4)
print(json.dumps({"calls": total, "calls_per_s": round(total / (time.time() - t0)), "warm_mib": warm,
                  "end_mib": samples[-1][1], "growth_after_warmup": round(samples[-1][1] / warm - 1, 4),
                  "samples": samples}))
ray.shutdown()
