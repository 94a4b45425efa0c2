"""The cache tier, trace replay and the fleet simulator work where torch cannot be imported.

``import radixkv``, the engine's bookkeeping (``KVCacheManager``, ``Scheduler``),
trace replay and the fleet simulator work in an environment without torch
(``pip install radixkv`` brings neither torch nor matplotlib). Each test
runs a fresh interpreter whose ``sys.meta_path`` starts with a finder that
refuses ``torch`` and ``matplotlib`` (and their submodules) exactly as a missing
package would, then exercises the public surface and checks that neither got
into ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

# Runs first in the child: block the packages, and prove the block works.
PRELUDE = """
import importlib.abc
import sys

BLOCKED = ("torch", "matplotlib")
assert not any(m.split(".")[0] in BLOCKED for m in sys.modules), "loaded at startup"


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Blocked())
for name in BLOCKED:
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise AssertionError(f"{name} imported despite the block")


def nothing_blocked_loaded():
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, f"loaded: {loaded}"
"""


def run_blocked(body: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``PRELUDE + body`` in a fresh interpreter (``sys.argv[1:] == args``)."""
    code = PRELUDE + textwrap.dedent(body) + "\nnothing_blocked_loaded()\nprint('OK')\n"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.endswith("OK\n"), proc.stdout + proc.stderr
    return proc


def test_caches_work_without_torch() -> None:
    run_blocked(
        """
        import pkgutil, importlib
        import numpy as np
        import radixkv
        import radixkv.cache
        from radixkv import BlockAllocator, HashBlockCache, NullCache, RadixCache

        # Every module of the cache tier imports without torch.
        for info in pkgutil.iter_modules(radixkv.cache.__path__, "radixkv.cache."):
            importlib.import_module(info.name)

        for make in (RadixCache, HashBlockCache, NullCache):
            alloc = BlockAllocator(num_blocks=8, block_size=2)
            cache = make(alloc)
            blocks = alloc.alloc(3)
            assert cache.insert(np.arange(6), blocks) == 0
            alloc.decref(blocks)
            caches = make is not NullCache
            assert cache.peek([0, 1, 2, 3, 9]) == (4 if caches else 0)
            m = cache.match([0, 1, 2, 3, 9])
            assert m.num_tokens == (4 if caches else 0), make
            alloc.decref(m.blocks)
            assert cache.evict(8) == (3 if caches else 0), make
            assert alloc.num_free == 8 and len(cache.held_blocks()) == 0
            cache.check()
        """
    )


def test_replay_and_cli_work_without_torch_or_matplotlib(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 1300, "output_length": 3, "hash_ids": [1, 2, 4]},
    ]
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_blocked(
        """
        import contextlib, importlib, io, json, os, pkgutil
        import radixkv.replay
        import radixkv.cli

        for info in pkgutil.iter_modules(radixkv.replay.__path__, "radixkv.replay."):
            importlib.import_module(info.name)

        trace, folder = sys.argv[1], sys.argv[2]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = radixkv.cli.main(["replay", trace, "--policy", "lru", "--capacity", "4"])
        assert code == 0, code
        result = json.loads(out.getvalue())
        assert result["total_hit_tokens"] == 1024, result  # request 2 hits blocks 1, 2

        # sweep without matplotlib: the CSV, a note, no PNG ...
        csv = os.path.join(folder, "sweep.csv")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = radixkv.cli.main(
                ["sweep", trace, "--policies", "lru,radix-lru", "--capacities", "4",
                 "--csv", csv, "--no-progress"]
            )
        assert code == 0, code
        assert os.path.exists(csv) and not os.path.exists(csv[:-4] + ".png")
        assert "no PNG" in out.getvalue(), out.getvalue()
        # ... and asking for one is bad input, before anything runs.
        png = os.path.join(folder, "asked.png")
        code = radixkv.cli.main(
            ["sweep", trace, "--policies", "lru", "--capacities", "4", "--csv", csv + "2",
             "--png", png]
        )
        assert code == 2 and not os.path.exists(csv + "2") and not os.path.exists(png)
        """,
        str(trace),
        str(tmp_path),
    )
    assert "--png needs matplotlib" in proc.stderr


def test_kv_manager_and_scheduler_work_without_torch() -> None:
    run_blocked(
        """
        from radixkv import BlockAllocator, KVCacheManager, RadixCache, make_cache
        from radixkv.cache import place_prompt
        from radixkv.engine import Request, SamplingParams, Scheduler

        kv = KVCacheManager(RadixCache(BlockAllocator(num_blocks=16, block_size=2)))
        assert kv.match_prefix("a", [1, 2, 3, 4, 5]) == 0
        assert kv.allocate_slots("a", 5)
        kv.append_output_tokens("a", [6])
        kv.free("a")
        assert kv.match_prefix("b", [1, 2, 3, 4, 5]) == 4
        kv.free("b")
        kv.check()
        cache = make_cache("radix", BlockAllocator(num_blocks=16, block_size=2))
        got = place_prompt(cache, [1, 2, 3, 4, 6])
        assert got.num_cached_tokens == 0 and len(got.blocks) == 2
        cache.allocator.decref_distinct(got.blocks)
        assert place_prompt(cache, [1, 2, 3, 4, 6]).num_cached_tokens == 4
        sched = Scheduler(kv)
        req = Request([1, 2, 3, 4, 7], SamplingParams(max_new_tokens=1))
        sched.add_request(req)
        out = sched.schedule()
        assert out.seqs[0].start == 4
        assert sched.postprocess(out, [9]) == [req]
        sched.check()
        try:
            from radixkv.engine import Engine  # the one name that needs torch
        except ImportError:
            pass
        else:
            raise AssertionError("Engine imported without torch")
        """
    )


def test_fleet_simulator_works_without_torch() -> None:
    run_blocked(
        """
        import numpy as np
        from radixkv.fleet import SimResult
        from radixkv.fleet.sim import SimClock, SimRequest, build_router, simulate

        clock = SimClock()
        reqs = [
            SimRequest(i, float(i), np.asarray([1, 2, 3 + i], dtype=np.int32), 1536, 2)
            for i in range(4)
        ]
        res = simulate(reqs, build_router("exact", clock), num_replicas=2, capacity_blocks=8,
                       clock=clock)
        assert isinstance(res, SimResult) and sum(res.served) == 4 and res.hit_tokens > 0, res
        """
    )


def test_the_torch_free_rooms_tests_collect_without_torch() -> None:
    """The cache, replay and text rooms' tests import where torch cannot be (their conftest
    chain is torch-free); a test there that needs torch skips or is in another room."""
    root = Path(__file__).resolve().parent.parent
    rooms = [str(root / "tests" / room) for room in ("cache", "replay", "text")]
    run_blocked(
        """
        import pytest
        rc = pytest.main([*sys.argv[1:], "--collect-only", "-q", "-p", "no:cacheprovider"])
        assert rc == 0, rc
        """,
        *rooms,
    )
