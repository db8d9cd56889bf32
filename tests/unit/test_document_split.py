"""Split documents (token-budget mode with ``split_documents``): spans pack like Megatron's
windows and every token of every drawn document is delivered exactly once, across steps and
across a save/resume."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_data_ext.dataplane.packing import pack_microbatch, span_view
from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.errors import PlanError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.inprocess import InProcessService
from megascale_data_ext.sources.demo_data import make_demo_data

L, M = 256, 2


def test_span_packs_with_positions_from_zero_and_the_next_token_as_last_label():
    doc = np.arange(10, 20)
    head, rest = span_view({"tokens": doc}, 0, 6, name="d"), span_view({"tokens": doc}, 6, None, name="d")
    assert head["next_token"] == 16 and rest["next_token"] is None
    b = pack_microbatch([{"tokens": np.array([1, 2, 3])}, head], seq_length=16, pad_id=0)
    assert b["cu_seqlens"].tolist() == [0, 3, 9, 16]
    assert b["position_ids"][0, 3:9].tolist() == list(range(6))  # restarts for the span, as GPTDataset
    assert b["labels"][0, 3:9].tolist() == [11, 12, 13, 14, 15, 16]  # last label continues the document
    assert b["loss_mask"][0, 3:9].tolist() == [1] * 6 and b["loss_mask"][0, 2] == 0
    c = pack_microbatch([rest], seq_length=8, pad_id=0)
    assert c["labels"][0, :4].tolist() == [17, 18, 19, 0] and c["loss_mask"][0, :4].tolist() == [1, 1, 1, 0]
    # one prediction per next token of the document: 6 + 3 = len(doc) - 1
    assert b["loss_mask"][0, 3:9].sum() + c["loss_mask"][0, :4].sum() == len(doc) - 1
    whole = {"tokens": doc}
    assert span_view(whole, 0, 10, name="d") is whole
    with pytest.raises(PlanError, match="outside its 10 tokens"):
        span_view(whole, 4, 12, name="step 3 source 1 position 7")


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("split"), seed=5, rows=150, image_rows=0, text_sources=1,
                          image_sources=0, megatron_rows=120)


def service(specs, **kw):
    cfg = ServiceConfig(sources=specs, seed=3, num_microbatches=M, seq_length=L, strategy="llm_balance",
                        strategy_args={"model": "gpt-tiny"}, buffer_size=256, tokens_per_step=2 * M * L,
                        split_documents=True, with_attention_mask=False, **kw)
    return InProcessService(cfg, ClientPlaceTree.from_sizes(dp=2))


def consume(svc, steps, start=0):
    """{(step, rank, microbatch): (spans [n, 4], batch)} for every fetching rank."""
    return {(s, r, j): (info["spans"], batch) for s in range(start, start + steps)
            for r in svc.topology.fetch_ranks() for j in range(M) for batch, info in [svc.get(s, j, r)]}


def documents(svc, keys):
    out = {}
    for s, pos in keys:
        ld = svc.loaders[s]
        sample = ld.source.read_report([int(ld.indices_at(np.asarray([pos]))[0])]).samples[0]
        out[(s, pos)] = np.asarray(sample.tokens)
    return out


def test_every_token_once_across_steps_and_full_microbatches(specs):
    svc = service(specs)
    got = consume(svc, 8)
    spans = {}
    for (step, _r, _j), (rows, batch) in got.items():
        cu = batch["cu_seqlens"]
        assert int(batch["num_tokens"][0]) == L  # every microbatch full, as Megatron's windows
        for i, (s, pos, a, b) in enumerate(rows.tolist()):
            end = cu[i + 1] - 1
            spans.setdefault((s, pos), []).append((a, b, batch["tokens"][0, cu[i]:end + 1], batch["labels"][0, end],
                                                   batch["loss_mask"][0, end]))
    carry: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s, pos, _i, a, n, _p in svc.planner.carry:  # remainders and whole pieces not placed yet
        carry.setdefault((s, pos), []).append((a, a + n))
    drawn = {(s, p) for s in range(len(specs)) for p in range(int(svc.planner.cursors[s]))}
    assert set(spans) | set(carry) == drawn  # nothing drawn is lost, nothing undrawn delivered
    docs = documents(svc, drawn)
    split = 0
    for key, doc in docs.items():
        parts = sorted(spans.get(key, []), key=lambda x: x[0])
        covered = sorted([(a, b) for a, b, *_ in parts] + carry.get(key, []))
        assert [a for a, _ in covered] == [0] + [b for _, b in covered[:-1]] and covered[-1][1] == len(doc), key
        for a, b, toks, last_label, last_mask in parts:
            np.testing.assert_array_equal(toks, doc[a:b])  # the span's real tokens
            if b < len(doc):  # continues elsewhere: its last position predicts the next token
                assert last_label == doc[b] and last_mask == 1
        split += len(parts) > 1
    assert split > 0 and any(len(d) > L for d in docs.values())  # the test really splits documents


def test_resume_continues_spans_exactly(specs):
    full = consume(service(specs), 6)
    first = service(specs)
    consume(first, 3)
    state = first.planner.state_dict(3)
    assert state["carry"]  # a remainder is waiting in the checkpoint
    again = service(specs)
    again.planner.load_state_dict(state)
    for key, (rows, batch) in consume(again, 3, start=3).items():
        np.testing.assert_array_equal(rows, full[key][0])
        np.testing.assert_array_equal(batch["tokens"], full[key][1]["tokens"])
        np.testing.assert_array_equal(batch["labels"], full[key][1]["labels"])
