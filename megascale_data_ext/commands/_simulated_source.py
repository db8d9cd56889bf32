"""A metadata-only Source Loader for `megascale-data simulate`: seeded navit-like summaries, no payloads."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from megascale_data_ext.dataplane.summary import SourceSummary
from megascale_data_ext.dataplane.workloads import Workload, generate_workload

CONTEXT = 8192
WORKLOAD = "navit"


class SimulatedSource:
    """A metadata-only Source Loader: `summary(start, count)` like `SourceLoader.summary_buffer`.

    Stream position p lives in block p // block of a seeded workload draw
    (``generate_workload(workload, block, seed=SeedSequence([seed, source, block_no]))``,
    clipped to the context), so its text tokens and image patch counts are a pure function of
    (seed, source, p): windows that overlap, or come from another Planner, agree. The stream
    is endless and unshuffled (sample index = position). Blocks are kept in a small LRU cache.
    """

    def __init__(self, source: int, name: str, *, seed: int, context: int = CONTEXT, workload: str = WORKLOAD,
                 block: int = 8192, cache_blocks: int = 1024):
        self.source, self.name, self.seed, self.context = source, name, int(seed), int(context)
        self.workload, self.block, self.cache_blocks = workload, int(block), int(cache_blocks)
        self._cache: OrderedDict[int, Workload] = OrderedDict()
        self.blocks_generated = 0

    def _block(self, k: int) -> Workload:
        wl = self._cache.get(k)
        if wl is not None:
            self._cache.move_to_end(k)
            return wl
        seed = int(np.random.SeedSequence([self.seed, self.source, k]).generate_state(1, dtype=np.uint64)[0])
        wl = generate_workload(self.workload, self.block, seed=seed, context=self.context).clip(self.context)
        self._cache[k] = wl
        self.blocks_generated += 1
        while len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)
        return wl

    @property
    def patch_size(self) -> int:
        return self._block(0).patch_size

    def summary(self, start: int, count: int) -> SourceSummary:
        """Metadata of stream positions [start, start + count)."""
        texts, n_imgs, patches = [], [], []
        pos, end = int(start), int(start) + int(count)
        while pos < end:
            k, lo = divmod(pos, self.block)
            hi = min(self.block, lo + end - pos)
            wl = self._block(k)
            texts.append(wl.text_tokens[lo:hi])
            n_imgs.append(np.diff(wl.image_offsets[lo:hi + 1]))
            patches.append(wl.image_patch_counts[wl.image_offsets[lo]:wl.image_offsets[hi]])
            pos += hi - lo
        n_img = np.concatenate(n_imgs) if n_imgs else np.zeros(0, np.int64)
        positions = np.arange(start, end, dtype=np.int64)
        return SourceSummary(
            source=self.source, name=self.name, positions=positions, indices=positions.copy(),
            text_tokens=np.concatenate(texts) if texts else np.zeros(0, np.int64),
            image_offsets=np.concatenate([[0], np.cumsum(n_img)]).astype(np.int64),
            image_patch_counts=np.concatenate(patches) if patches else np.zeros(0, np.int64),
        )
