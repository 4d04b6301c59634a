"""Serving under load: ``formcast serve`` against llama-cpp-python's own OpenAI server.

Both servers run as subprocesses on the same GGUF (the embedded SmolLM2) with the
same thread count. For each number of concurrent clients (default 1, 16, 64),
every client sends extraction requests back to back for a fixed time: chat
completions with formcast's extraction prompt over the texts of
``data/extraction.jsonl`` (five schemas), greedy, the output constrained by the
pydantic model's own JSON Schema (what a client of the ``openai`` package sends).
formcast gets it as OpenAI's ``response_format`` ``{"type": "json_schema", ...}``;
llama-cpp-python's server as its own form, ``{"type": "json_object", "schema": ...}``.

Reported per server and client count: requests/s, completion tokens/s (from each
server's ``usage``) counting every answer, and counting only the answers that are
complete and valid under their schema (``jsonschema`` with format checks, a
validator of neither server); p50/p99 latency; errors (non-200 answers, failed
connections); answers cut at ``max_tokens`` and complete answers the schema
rejects (both counted apart: the model's or the constraint's, not the
transport's); the server process's peak RSS and its mean RSS over the first and
the last 10 s of the run. Then the ratios of both tokens/s figures and the
targets: formcast >= 3x the peer's tokens/s at 16 clients (all tokens, and
tokens of valid answers), 0 errors and 0 invalid answers at 64 clients, RSS flat
within 10% (first vs last 10 s at the largest client count). ``--outputs DIR``
writes every answer (server, clients, schema, finish reason, text) as JSONL.

Each server is started, then warmed up before any load runs: its warm-up
requests must complete within ``--warmup-timeout`` (generous: a loaded machine
decodes slowly). formcast gets one per schema (it compiles and caches each
grammar), the peer one (it builds its grammar per request). A peer that does not
start or warm up in time is reported as such, with the machine's load average,
and the run goes on with formcast's figures alone (no ratio). Then, before each
measured phase, both servers get ``--warmup-load`` seconds (default 60) of the
same load, not measured: under load formcast's resident memory grows for its
first few dozen requests and then stays flat, as the kernels' per-shape caches
(oneDNN keeps one primitive per prompt-row count it has run) and the
allocator's heap reach their working size (its KV cache is resident from the
start: ``formcast serve`` commits it before serving). 240 s soaks show the
level: within about 1% from the 40th request on. ``--warmup-load 0`` measures
from the first request. Clients stop sending at the end of the fixed time; the requests then in
flight finish and count (the phase's seconds run until the last one ends).

``--soak SECONDS`` is the soak mode: formcast alone, one phase at the (single)
``--clients`` count for SECONDS, with the targets 0 errors, 0 invalid answers and
RSS flat within 10%.

Usage::

    python benchmarks/serve_load.py [--duration 60] [--clients 1,16,64] [--threads N]
                                    [--warmup-load 60] [--quantization auto] [--skip-peer]
                                    [--json out.json]
    python benchmarks/serve_load.py --soak 60 --clients 64

llama-cpp-python's server: ``pip install 'llama-cpp-python[server]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import psutil

sys.path.insert(0, str(Path(__file__).parent))
import extraction_quality as eq  # noqa: E402  (same folder: the texts and schemas)

TARGET_RATIO, RSS_TOLERANCE = 3.0, 0.10
MODEL_NAME = "bench"


@dataclass
class Phase:
    """One server at one client count."""

    clients: int
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    valid_tokens: int = 0  # of ``tokens``, those of complete answers valid under their schema
    cut: int = 0  # answers cut at max_tokens (finish_reason "length"): the model's, not an error
    invalid: int = 0  # complete answers their schema rejects
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds into phase, bytes)

    def row(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan"))
        first, last = _window_means(self.rss, 10.0)
        return {"clients": self.clients, "seconds": self.seconds, "requests": len(lat),
                "req_s": len(lat) / self.seconds,
                "tok_s": self.tokens / self.seconds,
                "valid_tok_s": self.valid_tokens / self.seconds,
                "p50_s": pick(0.50), "p99_s": pick(0.99),
                "errors": self.errors, "cut": self.cut, "invalid": self.invalid,
                "peak_rss_mb": max((b for _, b in self.rss), default=0) / 2**20,
                "rss_first_mb": first / 2**20, "rss_last_mb": last / 2**20,
                "rss_trace_mb": _trace(self.rss, 5.0)}


def _trace(samples: list[tuple[float, int]], every: float) -> list[tuple[float, float]]:
    """(seconds, MB) every ``every`` seconds of the samples: the shape of RSS over the phase."""
    trace: list[tuple[float, float]] = []
    for t, b in samples:
        if not trace or t >= trace[-1][0] + every:
            trace.append((round(t, 1), round(b / 2**20, 1)))
    return trace


def _window_means(samples: list[tuple[float, int]], window: float) -> tuple[float, float]:
    """Mean RSS over the first and the last ``window`` seconds of the samples."""
    if not samples:
        return 0.0, 0.0
    end = samples[-1][0]
    first = [b for t, b in samples if t <= samples[0][0] + window] or [samples[0][1]]
    last = [b for t, b in samples if t >= end - window] or [samples[-1][1]]
    return statistics.fmean(first), statistics.fmean(last)


# -- the servers ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NotReady(RuntimeError):
    """A server that did not start, or did not answer its warm-up, in time."""


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def start(name: str, cmd: list[str], url: str, log: Path, timeout: float) -> subprocess.Popen:
    """Start a server and wait until ``url`` answers 200 (raises NotReady)."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReady(f"{name} exited with code {proc.returncode} while starting; "
                           f"see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise NotReady(f"{name} did not answer {url} within {timeout:.0f} s ({_load()}); see {log}")


def warm_up(name: str, url: str, bodies: list[Body], timeout: float) -> float:
    """Requests (``bodies``) that must each complete (200) within what is left of
    ``timeout`` seconds (raises NotReady). Returns the seconds taken."""
    began = time.monotonic()
    for body in bodies:
        left = timeout - (time.monotonic() - began)
        try:
            resp = httpx.post(url + "/chat/completions", json=body.json, timeout=max(left, 1.0))
        except httpx.TimeoutException:
            raise NotReady(f"{name}'s warm-up request ({body.schema_name}) did not complete "
                           f"within {timeout:.0f} s ({_load()}); raise --warmup-timeout or "
                           "run on a quieter machine") from None
        if resp.status_code != 200:
            raise NotReady(f"{name}'s warm-up request ({body.schema_name}) answered "
                           f"{resp.status_code}: {resp.text[:300]}")
    return time.monotonic() - began


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RssSampler:
    """The process's resident memory every ``every`` seconds, on a thread."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.process, self.every = psutil.Process(pid), every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - start, self.process.memory_info().rss))
            except psutil.Error:
                return
            self._stop.wait(self.every)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- the load -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Body:
    """One request: its JSON body, and the schema its answer is checked against."""

    json: dict[str, Any]
    schema_name: str
    validator: Any  # jsonschema validator of the schema, format checks on


def payloads(formcast_form: bool, max_tokens: int) -> list[Body]:
    """One chat request per text; the schema in the server's own response_format form."""
    from formcast.extraction import extraction_messages

    bodies = []
    for item in eq.load_items(eq.DATA):
        schema = eq.SCHEMAS[item.schema].model_json_schema()
        fmt = ({"type": "json_schema", "json_schema": {"name": item.schema, "schema": schema,
                                                       "strict": True}}
               if formcast_form else {"type": "json_object", "schema": schema})
        body = {"model": MODEL_NAME, "messages": extraction_messages(item.text, schema),
                "temperature": 0, "max_tokens": max_tokens, "response_format": fmt}
        kind = jsonschema.validators.validator_for(schema)
        bodies.append(Body(body, item.schema, kind(schema, format_checker=kind.FORMAT_CHECKER)))
    return bodies


def _valid(body: Body, text: str) -> bool:
    try:
        return body.validator.is_valid(json.loads(text))
    except json.JSONDecodeError:
        return False


async def load_phase(url: str, bodies: list[Body], clients: int, duration: float, pid: int,
                     answers: Any, request_timeout: float) -> Phase:
    """``clients`` loops sending ``bodies`` round robin for ``duration`` seconds."""
    phase, counter = Phase(clients=clients), iter(range(10**9))
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=request_timeout, limits=limits) as http:
        begin = time.monotonic()
        end = begin + duration

        async def client() -> None:
            while time.monotonic() < end:
                body = bodies[next(counter) % len(bodies)]
                sent = time.monotonic()
                try:
                    resp = await http.post("/chat/completions", json=body.json)
                    if resp.status_code != 200:
                        raise RuntimeError(f"{resp.status_code}: {resp.text[:200]}")
                    data = resp.json()
                    choice = data["choices"][0]
                    text, tokens = choice["message"]["content"], data["usage"]["completion_tokens"]
                except Exception as exc:  # (every failure counts; a few are kept to show)
                    phase.errors += 1
                    if len(phase.error_samples) < 3:
                        phase.error_samples.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                phase.latencies.append(time.monotonic() - sent)
                phase.tokens += tokens
                cut = choice["finish_reason"] == "length"
                valid = not cut and _valid(body, text)
                phase.cut += cut
                phase.invalid += not cut and not valid
                phase.valid_tokens += tokens if valid else 0
                if answers is not None:
                    answers.write(json.dumps({"clients": clients, "schema": body.schema_name,
                                              "finish_reason": choice["finish_reason"],
                                              "valid": valid, "tokens": tokens, "text": text},
                                             ensure_ascii=False) + "\n")

        with RssSampler(pid) as rss:
            await asyncio.gather(*(client() for _ in range(clients)))
        phase.seconds = time.monotonic() - begin
        phase.rss = rss.samples
    return phase


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What every server runs: client counts, seconds each, and the limits."""

    clients: list[int]
    duration: float
    start_timeout: float
    warmup_timeout: float
    warmup_load: float
    request_timeout: float
    logs: Path
    outputs: Path | None


def run_server(name: str, cmd: list[str], port: int, bodies: list[Body], plan: Plan, *,
               warm_each_schema: bool) -> list[Phase]:
    """Start, warm up and load one server (raises NotReady when it never gets ready).

    ``warm_each_schema``: the warm-up sends one request per schema (a server that
    compiles and caches each grammar), else one request."""
    url = f"http://127.0.0.1:{port}/v1"
    began = time.monotonic()
    proc = start(name, cmd, url + "/models", plan.logs / f"{name}.log", plan.start_timeout)
    answers = None if plan.outputs is None else (plan.outputs / f"{name}.jsonl").open("w")
    try:
        ready = time.monotonic() - began
        warm = list({b.schema_name: b for b in bodies}.values()) if warm_each_schema \
            else bodies[:1]
        took = warm_up(name, url, warm, plan.warmup_timeout)
        print(f"  {name:9} started in {ready:.0f} s, warm-up ({len(warm)} requests) {took:.0f} s, "
              f"{_load()}", flush=True)
        phases = []
        for n in plan.clients:
            if plan.warmup_load > 0:
                warm_phase = asyncio.run(load_phase(url, bodies, n, plan.warmup_load, proc.pid,
                                                    None, plan.request_timeout))
                row = warm_phase.row()
                print(f"  {name:9} warm-up load at {n} clients: {row['requests']} requests in "
                      f"{row['seconds']:.0f} s, {row['errors']} errors, RSS "
                      f"{row['rss_first_mb']:.0f} -> {row['rss_last_mb']:.0f} MB (not measured)",
                      flush=True)
            phase = asyncio.run(load_phase(url, bodies, n, plan.duration, proc.pid, answers,
                                           plan.request_timeout))
            print(f"  {name:9} {_fmt(phase.row())}  ({_load()})", flush=True)
            for sample in phase.error_samples:
                print(f"    error: {sample}")
            phases.append(phase)
        return phases
    finally:
        stop(proc)
        if answers is not None:
            answers.close()


def _fmt(row: dict[str, Any]) -> str:
    return (f"clients {row['clients']:3}  {row['requests']:5} req in {row['seconds']:.0f} s  "
            f"{row['req_s']:6.2f} req/s  "
            f"{row['tok_s']:7.1f} tok/s ({row['valid_tok_s']:.1f} in valid answers)  "
            f"p50 {row['p50_s']:6.2f} s  p99 {row['p99_s']:6.2f} s  errors {row['errors']}  "
            f"cut {row['cut']}  invalid {row['invalid']}  peak RSS {row['peak_rss_mb']:6.0f} MB  "
            f"RSS first/last 10 s {row['rss_first_mb']:.0f}/{row['rss_last_mb']:.0f} MB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per client count")
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="formcast alone, one phase at --clients (one count) for SECONDS; "
                         "targets: 0 errors, 0 invalid answers, RSS flat")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quantization", default="auto", help="formcast's: none|auto|int4|int8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds a server may take to answer /v1/models")
    ap.add_argument("--warmup-timeout", type=float, default=1800.0,
                    help="seconds the warm-up requests (one per schema) may take together")
    ap.add_argument("--warmup-load", type=float, default=60.0, metavar="SECONDS",
                    help="seconds of the same load before each measured phase, not measured")
    ap.add_argument("--request-timeout", type=float, default=1800.0,
                    help="seconds one request under load may take before it counts as an error")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/serve_load"))
    ap.add_argument("--outputs", type=Path, default=None,
                    help="folder: every answer of each server as <server>.jsonl")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    args = ap.parse_args(argv)
    # (SIGTERM unwinds like Ctrl-C, so that the server started last is stopped too)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    clients = [int(c) for c in args.clients.split(",")]
    if args.soak is not None and len(clients) != 1:
        ap.error("--soak takes one --clients count (e.g. --soak 60 --clients 64)")
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.outputs is not None:
        args.outputs.mkdir(parents=True, exist_ok=True)
    plan = Plan(clients=clients, duration=args.soak or args.duration,
                start_timeout=args.start_timeout, warmup_timeout=args.warmup_timeout,
                warmup_load=args.warmup_load,
                request_timeout=args.request_timeout, logs=args.logs, outputs=args.outputs)

    from formcast.engine.hub import resolve_model

    gguf = resolve_model("smollm2").path
    mode = f"soak of {plan.duration:.0f} s" if args.soak else f"{plan.duration:.0f} s per count"
    print(f"model {gguf.name}, {args.threads} threads, {mode}, clients {clients}, {_load()}")
    port = free_port()
    ours = [sys.executable, "-m", "formcast", "serve", "--model", str(gguf), "--port", str(port),
            "--served-model-name", MODEL_NAME, "--num-threads", str(args.threads),
            "--quantization", args.quantization, "--max-concurrency", "1024", "--device", "cpu"]
    results: dict[str, list[Phase]] = {
        "formcast": run_server("formcast", ours, port, payloads(True, args.max_tokens), plan,
                               warm_each_schema=True)}
    peer_note = None
    if not (args.skip_peer or args.soak):
        port = free_port()
        peer = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                "--port", str(port), "--model_alias", MODEL_NAME, "--n_threads",
                str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "4096"]
        try:
            results["llama.cpp"] = run_server("llama.cpp", peer, port,
                                              payloads(False, args.max_tokens), plan,
                                              warm_each_schema=False)
        except NotReady as exc:
            peer_note = str(exc)
            print(f"  llama.cpp NOT MEASURED: {exc}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "threads": args.threads, "quantization": args.quantization, "soak": args.soak,
            "warmup_load_s": args.warmup_load,
            "peer_note": peer_note,
            "rows": {name: [p.row() for p in phases] for name, phases in results.items()}},
            indent=2) + "\n")
    return report(results, clients, soak=args.soak is not None, peer_note=peer_note)


def report(results: dict[str, list[Phase]], clients: list[int], *, soak: bool,
           peer_note: str | None) -> int:
    ours = {p.clients: p.row() for p in results["formcast"]}
    ok = True
    print()
    if "llama.cpp" in results:
        peer = {p.clients: p.row() for p in results["llama.cpp"]}
        for n in clients:
            ratio = ours[n]["tok_s"] / peer[n]["tok_s"] if peer[n]["tok_s"] else float("inf")
            valid = (ours[n]["valid_tok_s"] / peer[n]["valid_tok_s"]
                     if peer[n]["valid_tok_s"] else float("inf"))
            line = (f"clients {n:3}: formcast/llama.cpp tokens/s {ratio:.2f}x all tokens, "
                    f"{valid:.2f}x in valid answers")
            if n == 16:
                ok &= min(ratio, valid) >= TARGET_RATIO
                verdict = "PASS" if min(ratio, valid) >= TARGET_RATIO else "FAIL"
                line += f" (target >= {TARGET_RATIO}x, both: {verdict})"
            print(line)
    elif peer_note is not None:
        ok = False
        print(f"no ratio: the peer was not measured ({peer_note})")
    top = ours[max(clients)]
    failed = top["errors"] + top["invalid"]
    ok &= failed == 0
    what = f"over a {top['seconds']:.0f} s soak at" if soak else "at"
    print(f"errors and invalid answers {what} {max(clients)} clients: {top['errors']} + "
          f"{top['invalid']} in {top['requests'] + top['errors']} requests "
          f"(target 0: {'PASS' if failed == 0 else 'FAIL'})")
    drift = (top["rss_last_mb"] - top["rss_first_mb"]) / top["rss_first_mb"]
    ok &= abs(drift) <= RSS_TOLERANCE
    verdict = "PASS" if abs(drift) <= RSS_TOLERANCE else "FAIL"
    print(f"RSS first vs last 10 s at {max(clients)} clients: {drift:+.1%} "
          f"(target within {RSS_TOLERANCE:.0%}: {verdict})")
    shape = [f"{t:.0f} s {mb:.0f}" for t, mb in top["rss_trace_mb"][::6]]  # (every 30 s)
    print(f"RSS over the phase (MB): {', '.join(shape)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
