"""The collector's settings are the caller's again after a verification, and garbage is still collected."""

from __future__ import annotations

import gc
import weakref

from shardproof.gc_tuning import YOUNG_THRESHOLD, fewer_collections


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_settings_restored_and_cycles_collected() -> None:
    before = gc.get_threshold()
    with fewer_collections():
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_callers_freeze_stays() -> None:
    gc.freeze()
    try:
        with fewer_collections():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
