"""The actors' malloc arena cap (`runtime.malloc`): in their runtime_env, overridable, off on request."""

from __future__ import annotations

from megascale_data_ext.runtime.malloc import DEFAULT_ARENAS, actor_process_options


def test_actors_start_with_capped_arenas_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("MEGASCALE_MALLOC_ARENAS", raising=False)
    assert actor_process_options() == {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": str(DEFAULT_ARENAS)}}}
    monkeypatch.setenv("MEGASCALE_MALLOC_ARENAS", "4")
    assert actor_process_options()["runtime_env"]["env_vars"]["MALLOC_ARENA_MAX"] == "4"
    monkeypatch.setenv("MEGASCALE_MALLOC_ARENAS", "0")
    assert actor_process_options() == {}
