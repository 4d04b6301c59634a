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

Usage::

    python benchmarks/serve_load.py [--duration 60] [--clients 1,16,64] [--threads N]
                                    [--quantization auto] [--skip-peer]

llama-cpp-python's server: ``pip install 'llama-cpp-python[server]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
        return {"clients": self.clients, "requests": len(lat), "req_s": len(lat) / self.seconds,
                "tok_s": self.tokens / self.seconds,
                "valid_tok_s": self.valid_tokens / self.seconds,
                "p50_s": pick(0.50), "p99_s": pick(0.99),
                "errors": self.errors, "cut": self.cut, "invalid": self.invalid,
                "peak_rss_mb": max((b for _, b in self.rss), default=0) / 2**20,
                "rss_first_mb": first / 2**20, "rss_last_mb": last / 2**20}


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


def start(cmd: list[str], url: str, log: Path, timeout: float = 300.0) -> subprocess.Popen:
    """Start a server and wait until ``url`` answers 200."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} did not start in {timeout:.0f} s; see {log}")


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
                     answers: Any) -> Phase:
    """``clients`` loops sending ``bodies`` round robin for ``duration`` seconds."""
    phase, counter = Phase(clients=clients), iter(range(10**9))
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
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


def run_server(name: str, cmd: list[str], port: int, bodies: list[Body], clients: list[int],
               duration: float, logs: Path, outputs: Path | None) -> list[Phase]:
    url = f"http://127.0.0.1:{port}/v1"
    proc = start(cmd, url + "/models", logs / f"{name}.log")
    answers = None if outputs is None else (outputs / f"{name}.jsonl").open("w")
    try:
        phases = []
        # warm-up: one request per schema (formcast compiles each grammar once)
        for body in {b.schema_name: b for b in bodies}.values():
            httpx.post(url + "/chat/completions", json=body.json, timeout=600)
        for n in clients:
            phase = asyncio.run(load_phase(url, bodies, n, duration, proc.pid, answers))
            print(f"  {name:9} {_fmt(phase.row())}", flush=True)
            for sample in phase.error_samples:
                print(f"    error: {sample}")
            phases.append(phase)
        return phases
    finally:
        stop(proc)
        if answers is not None:
            answers.close()


def _fmt(row: dict[str, Any]) -> str:
    return (f"clients {row['clients']:3}  {row['requests']:5} req  {row['req_s']:6.2f} req/s  "
            f"{row['tok_s']:7.1f} tok/s ({row['valid_tok_s']:.1f} in valid answers)  "
            f"p50 {row['p50_s']:6.2f} s  p99 {row['p99_s']:6.2f} s  errors {row['errors']}  "
            f"cut {row['cut']}  invalid {row['invalid']}  peak RSS {row['peak_rss_mb']:6.0f} MB  "
            f"RSS first/last 10 s {row['rss_first_mb']:.0f}/{row['rss_last_mb']:.0f} MB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per client count")
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quantization", default="auto", help="formcast's: none|auto|int4|int8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/serve_load"))
    ap.add_argument("--outputs", type=Path, default=None,
                    help="folder: every answer of each server as <server>.jsonl")
    args = ap.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.outputs is not None:
        args.outputs.mkdir(parents=True, exist_ok=True)

    from formcast.engine.hub import resolve_model

    gguf = resolve_model("smollm2").path
    print(f"model {gguf.name}, {args.threads} threads, {args.duration:.0f} s per client count, "
          f"clients {clients}")
    port = free_port()
    ours = [sys.executable, "-m", "formcast", "serve", "--model", str(gguf), "--port", str(port),
            "--served-model-name", MODEL_NAME, "--num-threads", str(args.threads),
            "--quantization", args.quantization, "--max-concurrency", "1024", "--device", "cpu"]
    results = {"formcast": run_server("formcast", ours, port, payloads(True, args.max_tokens),
                                      clients, args.duration, args.logs, args.outputs)}
    if not args.skip_peer:
        port = free_port()
        peer = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                "--port", str(port), "--model_alias", MODEL_NAME, "--n_threads",
                str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "4096"]
        results["llama.cpp"] = run_server("llama.cpp", peer, port,
                                          payloads(False, args.max_tokens), clients,
                                          args.duration, args.logs, args.outputs)
    return report(results, clients)


def report(results: dict[str, list[Phase]], clients: list[int]) -> int:
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
    top = ours[max(clients)]
    failed = top["errors"] + top["invalid"]
    ok &= failed == 0
    print(f"errors and invalid answers at {max(clients)} clients: {top['errors']} + "
          f"{top['invalid']} (target 0: {'PASS' if failed == 0 else 'FAIL'})")
    drift = (top["rss_last_mb"] - top["rss_first_mb"]) / top["rss_first_mb"]
    ok &= abs(drift) <= RSS_TOLERANCE
    verdict = "PASS" if abs(drift) <= RSS_TOLERANCE else "FAIL"
    print(f"RSS first vs last 10 s at {max(clients)} clients: {drift:+.1%} "
          f"(target within {RSS_TOLERANCE:.0%}: {verdict})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
