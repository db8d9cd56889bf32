"""Service start-up to a client's first microbatch, for A/B runs of two checkouts.

    megascale-data demo-data --out /tmp/dd
    for tree in /path/a /path/b; do (cd $tree && PYTHONPATH=$tree python scripts/startup_first_batch.py); done

Prints one JSON line: ray.init seconds, first microbatch after ray.init, the service's start-up phases.
"""
import sys, time, json
import ray
from megascale_data_ext.config import compose_config, load_config
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.runtime.service import DataService
from megascale_data_ext.runtime.client import Client
import megascale_data_ext
root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/dd"
cfg = compose_config(["sources=demo_text", f"data.data_root={root}", "data.ray.num_cpus=2"], "train_gpt")
scfg = load_config(cfg.data).to_service_config()
tree = ClientPlaceTree.from_sizes(tp=1, pp=1, dp=2)
t0 = time.perf_counter()
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
t1 = time.perf_counter()
svc = DataService(scfg, tree, progress=None)
handles = svc.start()
client = Client.connect(handles, 0, num_microbatches=scfg.num_microbatches)
mb = client.next_microbatch()
t2 = time.perf_counter()
print(json.dumps({"tree": megascale_data_ext.__file__, "ray_init_s": round(t1 - t0, 2),
                  "first_batch_after_init_s": round(t2 - t1, 2),
                  "phases": {k: round(v, 2) for k, v in svc.phases.items()}}))
svc.stop(); ray.shutdown()
