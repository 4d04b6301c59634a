"""The caller's side of a parallel engine: one process per rank on this machine.

:class:`ParallelEngine` answers like :class:`formcast.engine.Engine` (``add_request``,
``step``, ``generate``, ``abort_request``, ``tokenizer``) and spreads requests over
its ranks, each to the least loaded (tokens of its unfinished requests: prompt
plus remaining budget, which is what its KV cache and queue will hold). A step
steps every rank (they run their forwards in lockstep) and merges the outputs.
A worker that dies is noticed at once: the call raises :class:`EngineError` and
every other worker is stopped.
"""

from __future__ import annotations

import itertools
import pickle
import socket
import time
from types import SimpleNamespace
from collections.abc import Sequence as SequenceABC
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from formcast.engine.parallel.config import ParallelConfig
from formcast.engine.parallel.placement import default_placement, plan_placement
from formcast.engine.sampling_params import SamplingParams
from formcast.engine.sequence import Request, RequestOutput
from formcast.engine.errors import EngineError, RequestError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ParallelEngine:
    """Ranks of one model over torch.distributed; build with :meth:`launch`."""

    def __init__(self, procs, conns, config: ParallelConfig, tokenizer, info: dict,
                 num_experts: int | None, num_moe_layers: int) -> None:
        self._procs = procs
        self._conns = conns
        self.config = config
        self.tokenizer = tokenizer
        self._describe(info)
        self.num_experts = num_experts
        self.num_moe_layers = num_moe_layers
        self._owner: dict[str, int] = {}            # request id -> rank
        self._budget: dict[str, int] = {}           # request id -> tokens it may still hold
        self._load = [0] * config.dp
        self._ids = itertools.count()
        self._closed = False

    def _describe(self, info: dict) -> None:
        """What rank 0 reports of its engine (all ranks hold the same model)."""
        self.name = info["name"]
        self.max_model_len = info["max_model_len"]
        self.model = SimpleNamespace(config=info.get("config"))  # the model's shape, no weights
        self.device = torch.device(info.get("device", "cpu"))
        self.dtype = info.get("dtype")
        self.quantization = info.get("quantization")

    # -- construction ---------------------------------------------------------------
    @classmethod
    def launch(cls, source: str, config: ParallelConfig, **engine_options) -> "ParallelEngine":
        """Spawn ``config.dp`` ranks serving the model at ``source`` (a registry name
        or path, as :meth:`Engine.from_pretrained` takes it)."""
        from formcast.engine.hub import resolve_model
        from formcast.engine.loader.deepseek_v4 import (is_deepseek_v4_folder,
                                                        read_deepseek_v4_config)
        from formcast.engine.tokenizer import Tokenizer
        from formcast.engine.tokenizer_files import cached_gguf_tokenizer

        resolved = resolve_model(source)
        model_config = (read_deepseek_v4_config(resolved.path)
                        if resolved.kind != "gguf" and is_deepseek_v4_folder(resolved.path)
                        else None)  # dense models: plain data parallel
        tokenizer = (cached_gguf_tokenizer(resolved.path) if resolved.kind == "gguf"
                     else Tokenizer.from_hf_dir(resolved.path))
        device = str(engine_options.get("device", "auto"))
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        backend = config.backend if config.backend != "auto" else ("nccl" if cuda else "gloo")
        num_experts = getattr(model_config, "n_routed_experts", None)
        layers = getattr(model_config, "mlp_layer_types", None) or []
        placements = None
        if config.ep > 1 and num_experts:
            placements = [default_placement(num_experts, config.dp, config.spare_expert_slots)
                          for _ in layers]
        engine_options = {"device": "cpu" if not cuda else "cuda", **engine_options}
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{_free_port()}"
        procs, conns = [], []
        for rank in range(config.dp):
            ours, theirs = ctx.Pipe()
            from formcast.engine.parallel.worker import worker_main

            proc = ctx.Process(target=worker_main, daemon=True, name=f"formcast-rank{rank}",
                               args=(rank, config.dp, init, backend, str(resolved.path),
                                     engine_options, placements, theirs))
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        engine = cls(procs, conns, config, tokenizer, {"name": "", "max_model_len": 0},
                     num_experts if placements else None, len(layers) if placements else 0)
        infos = engine._gather("ready")
        engine._describe(infos[0])
        return engine

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt: Request | SequenceABC[int], params: SamplingParams | None = None,
                    *, constraint=None, request_id: str | None = None) -> str:
        """Queue one request on the least loaded rank; returns its id. A constraint
        must be able to travel to the rank's process (a fresh formcast.grammars
        matcher can)."""
        prompt, params, constraint, request_id = Request.unpack(prompt, params, constraint,
                                                                request_id)
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._owner:
            raise RequestError(f"request id {request_id!r} is already in flight")
        rank = min(range(self.config.dp), key=lambda r: (self._load[r], r))
        try:  # the constraint travels pickled (formcast.grammars matchers rebuild themselves)
            self._send(rank, "add", {"prompt": list(prompt), "params": params,
                                     "request_id": request_id, "constraint": constraint})
        except (TypeError, AttributeError, pickle.PicklingError) as exc:
            raise RequestError(f"the request cannot be sent to rank {rank}: {exc}") from exc
        status, msg = self._recv(rank)
        if status == "error":
            raise RequestError(msg)
        budget = len(prompt) + params.max_tokens
        self._owner[request_id], self._budget[request_id] = rank, budget
        self._load[rank] += budget
        return request_id

    def abort_request(self, request_id: str) -> bool:
        rank = self._owner.get(request_id)
        if rank is None:
            return False
        self._send(rank, "abort", request_id)
        return bool(self._recv(rank)[1])

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """One step of every rank; the outputs of all (``finished_only``: of the
        requests that finished, as :meth:`Engine.step`)."""
        outputs = [out for outs in self._gather("step", broadcast=("step", finished_only))
                   for out in outs]
        for out in outputs:
            if out.finished and out.request_id in self._owner:
                rank = self._owner.pop(out.request_id)
                self._load[rank] -= self._budget.pop(out.request_id)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 *, constraints=None) -> list[RequestOutput]:
        """Run a batch to completion; outputs in prompt order."""
        n = len(prompts)
        plist = params if isinstance(params, list) else [params] * n
        if len(plist) != n:
            raise RequestError(f"got {n} prompts but {len(plist)} params")
        clist = constraints if constraints is not None else [None] * n
        if len(clist) != n:
            raise RequestError(f"got {n} prompts but {len(clist)} constraints")
        ids = [self.add_request(p, sp, constraint=c) for p, sp, c in zip(prompts, plist, clist)]
        done: dict[str, RequestOutput] = {}
        while len(done) < n:
            for out in self.step(finished_only=True):
                done[out.request_id] = out
        return [done[i] for i in ids]

    def forward_logits(self, token_ids: SequenceABC[int]) -> torch.Tensor:
        """Float32 logits ``[T, V]`` of one sequence, scored on rank 0 (the others
        join its forwards' expert exchanges)."""
        for rank in range(self.config.dp):
            self._send(rank, "logits", list(token_ids) if rank == 0 else None)
        return self._gather("logits")[0]

    def continuation_logprobs(self, prefixes: SequenceABC[SequenceABC[int]],
                              continuations: SequenceABC[SequenceABC[SequenceABC[int]]]
                              ) -> list[list[list[float]]]:
        """As :meth:`Engine.continuation_logprobs`, each from a whole forward on rank 0."""
        out = []
        for prefix, conts in zip(prefixes, continuations):
            out.append([])
            for cont in conts:
                logits = self.forward_logits(list(prefix) + list(cont))
                lp = torch.log_softmax(logits[len(prefix) - 1:-1], dim=-1)
                out[-1].append(lp.gather(1, torch.tensor(list(cont))[:, None]).squeeze(1).tolist())
        return out

    # -- expert load balancing --------------------------------------------------------
    def expert_loads(self) -> list[torch.Tensor]:
        """Tokens routed to each expert so far, per MoE layer, summed over ranks."""
        if self.num_experts is None:
            raise EngineError("this engine holds no expert-parallel MoE layers")
        per_rank = self._gather("loads", broadcast=("loads", None))
        return [sum(rank[i] for rank in per_rank) for i in range(self.num_moe_layers)]

    def rebalance(self, loads: list[torch.Tensor] | None = None) -> list:
        """Plan a placement per MoE layer from the measured (or given) loads, with
        replicas of hot experts in the spare slots, and apply it on every rank
        (between steps; outputs do not change). Returns the placements."""
        loads = loads if loads is not None else self.expert_loads()
        slots = -(-self.num_experts // self.config.dp) + self.config.spare_expert_slots
        plans = [plan_placement([float(x) for x in layer], self.config.dp, slots)
                 for layer in loads]
        self._gather("place", broadcast=("place", plans))
        return plans

    def worker_stats(self) -> list[dict]:
        return self._gather("stats", broadcast=("stats", None))

    # -- plumbing ---------------------------------------------------------------------
    def _send(self, rank: int, cmd: str, arg) -> None:
        if self._closed:
            raise EngineError("the parallel engine is shut down")
        try:
            self._conns[rank].send((cmd, arg))
        except (BrokenPipeError, OSError):
            self._fail(f"rank {rank} is gone (exit code {self._procs[rank].exitcode})")

    def _recv(self, rank: int):
        conn, proc = self._conns[rank], self._procs[rank]
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            ready = wait([conn, proc.sentinel], timeout=min(1.0, deadline - time.monotonic()))
            if conn in ready:
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):  # closed, or reset by a dying process
                    proc.join(timeout=1.0)
                    self._fail(f"rank {rank} died (exit code {proc.exitcode})")
                if status == "fatal":
                    self._fail(f"rank {rank} failed:\n{payload}")
                return status, payload
            if proc.sentinel in ready or not proc.is_alive():
                self._fail(f"rank {rank} died (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                self._fail(f"rank {rank} did not answer within {self.config.timeout_s} s")

    def _gather(self, expect: str, broadcast=None) -> list:
        """Send ``broadcast`` to every rank (if given), then collect one answer each.
        Any dead rank is noticed while waiting for any other."""
        if broadcast is not None:
            for rank in range(self.config.dp):
                self._send(rank, *broadcast)
        answers: dict[int, object] = {}
        while len(answers) < self.config.dp:
            pending = [r for r in range(self.config.dp) if r not in answers]
            for rank in pending:
                if not self._procs[rank].is_alive():
                    self._fail(f"rank {rank} died (exit code {self._procs[rank].exitcode})")
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            wait(waitables, timeout=1.0)
            for rank in pending:
                if self._conns[rank].poll():
                    status, payload = self._recv(rank)
                    if status not in (expect, "ok"):
                        self._fail(f"rank {rank} answered {status}: {payload}")
                    answers[rank] = payload
        return [answers[r] for r in range(self.config.dp)]

    def _fail(self, why: str):
        self.shutdown()
        raise EngineError(f"parallel engine: {why}")

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force); idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send(("stop", None))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for conn in self._conns:
            conn.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
