"""One rank of a parallel engine: its own :class:`Engine` (requests, KV cache or
states), its slice of the experts, and the lockstep that keeps the ranks'
forwards aligned.

Ranks meet inside every MoE layer (the expert exchange), so they must run the
same number of forwards. Before each forward a rank says so (all-reduce of 1);
a rank done with its step keeps saying 0 and, while any other rank still runs
one, runs an empty forward along (:meth:`DeepseekV4ForCausalLM.idle_forward`);
the step ends for all when every rank says 0.

Started by :class:`formcast.engine.parallel.ParallelEngine` (torch.multiprocessing,
one machine), it serves commands from the caller over a pipe.
"""

from __future__ import annotations

import gc
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from formcast.engine.parallel.placement import ExpertPlacement


class Lockstep:
    """Aligns the ranks' forwards of ``model`` (see the module text)."""

    def __init__(self, model, group=None) -> None:
        self.model = model
        self.group = group
        self.forwards = 0  # real forwards this rank ran
        self.idle_forwards = 0

    def enter_forward(self) -> None:
        flag = torch.ones(1, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.forwards += 1

    def finish_step(self) -> None:
        while True:
            flag = torch.zeros(1, dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if not int(flag):
                return
            self.model.idle_forward()
            self.idle_forwards += 1


def expert_layers(model) -> list:
    """The MoE blocks of the main layers whose routed experts are split (in order)."""
    return [layer.mlp for layer in getattr(model.model, "layers", [])
            if hasattr(getattr(layer, "mlp", None), "experts")]


def shard_experts(model, placements: list[ExpertPlacement], group=None) -> None:
    """Replace each MoE layer's routed experts by its expert-parallel slice."""
    from formcast.engine.parallel.moe import ExpertParallelExperts

    for moe, placement in zip(expert_layers(model), placements, strict=True):
        ex = moe.experts
        moe.experts = ExpertParallelExperts(ex.gate_up_proj.data, ex.down_proj.data, ex.limit,
                                            placement, group)
        moe.experts.batch_invariant = ex.batch_invariant  # (the model's mode, set before)
    model.lockstep = Lockstep(model, group)


def worker_main(rank: int, world: int, init_method: str, backend: str, source: str,
                engine_options: dict[str, Any], placements: list[ExpertPlacement] | None,
                conn) -> None:
    """Entry of a spawned rank: set up the group and the engine, then serve."""
    from formcast.engine.engine import Engine

    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
        options = dict(engine_options)
        if backend == "nccl":
            options["device"] = f"cuda:{rank % torch.cuda.device_count()}"
            # the rank's GPU is this process's: streams, events and graph captures
            # follow the current device
            torch.cuda.set_device(options["device"])
        engine = Engine.from_pretrained(source, **options)
        if placements is not None:
            shard_experts(engine.model, placements)
        conn.send(("ready", {"name": engine.name, "max_model_len": engine.max_model_len,
                             "config": engine.model.config, "device": str(engine.device),
                             "dtype": engine.dtype, "quantization": engine.quantization}))
    except Exception:
        conn.send(("fatal", traceback.format_exc()))
        return
    serve(engine, conn)
    del engine
    gc.collect()
    dist.destroy_process_group()


def serve(engine, conn) -> None:
    """Answer the caller's commands until "stop" (or the pipe closes)."""
    from formcast.engine.errors import RequestError

    lockstep = getattr(engine.model, "lockstep", None)
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "add":
                try:
                    engine.add_request(arg["prompt"], arg["params"], request_id=arg["request_id"],
                                       constraint=arg.get("constraint"))
                    conn.send(("ok", None))
                except RequestError as exc:
                    conn.send(("error", str(exc)))
            elif cmd == "step":
                outputs = engine.step(finished_only=bool(arg))
                if lockstep is not None:
                    lockstep.finish_step()
                conn.send(("ok", outputs))
            elif cmd == "logits":  # one rank scores, the others join its forwards
                logits = engine.forward_logits(arg) if arg is not None else None
                if lockstep is not None:
                    lockstep.finish_step()
                conn.send(("ok", logits))
            elif cmd == "abort":
                conn.send(("ok", engine.abort_request(arg)))
            elif cmd == "loads":
                conn.send(("ok", [m.experts.loads.clone() for m in expert_layers(engine.model)]))
            elif cmd == "place":
                for moe, placement in zip(expert_layers(engine.model), arg, strict=True):
                    moe.experts.place(placement)
                conn.send(("ok", None))
            elif cmd == "stats":
                conn.send(("ok", {"forwards": getattr(lockstep, "forwards", 0),
                                  "idle_forwards": getattr(lockstep, "idle_forwards", 0),
                                  "pid": os.getpid()}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception:
            conn.send(("fatal", traceback.format_exc()))
            return


def main(argv: list[str] | None = None) -> None:
    """Batch generation on ranks started by torchrun (one process per rank, on one
    or several nodes): ``torchrun --nproc-per-node N [--nnodes ...] -m
    formcast.engine.parallel.worker --model PATH --prompts in.jsonl --output
    out.jsonl [--ep N]``. Rank 0 reads the prompts (a JSON object per line,
    ``{"prompt": text}`` or ``{"prompt_ids": [...]}``) and writes one result per
    line in the same order; the prompts are spread over the ranks."""
    import argparse
    import json

    from formcast.engine.engine import Engine
    from formcast.engine.parallel.placement import default_placement
    from formcast.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(prog="python -m formcast.engine.parallel.worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--ep", type=int, default=0, help="expert parallel ranks (default: all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)  # streams, events and graph captures follow it
    engine = Engine.from_pretrained(args.model, device=device, spec="none")
    cfg = engine.model.config
    ep = args.ep or world
    if ep not in (1, world):
        raise SystemExit(f"--ep must be 1 or the number of ranks ({world})")
    if ep > 1 and getattr(cfg, "n_routed_experts", None):
        shard_experts(engine.model, [default_placement(cfg.n_routed_experts, world, 1)
                                     for _ in expert_layers(engine.model)])
    items = [None]
    if rank == 0:
        with open(args.prompts) as f:
            items = [[json.loads(line) for line in f if line.strip()]]
    dist.broadcast_object_list(items, src=0)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    mine = {}
    for i, item in enumerate(items[0]):
        if i % world == rank:
            ids = item.get("prompt_ids") or engine.tokenizer.encode(item["prompt"])
            mine[engine.add_request(ids, sp, request_id=f"line-{i}")] = i
    results = {}
    lockstep = getattr(engine.model, "lockstep", None)
    while True:
        for out in engine.step(finished_only=True):
            if out.finished:
                results[mine[out.request_id]] = {"text": out.text, "token_ids": list(out.token_ids),
                                                 "finish_reason": out.finish_reason, "rank": rank}
        if lockstep is not None:
            lockstep.finish_step()
        busy = torch.tensor([int(engine.has_unfinished_requests())])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if not int(busy):
            break
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank == 0:
        merged = {i: r for part in gathered for i, r in part.items()}
        with open(args.output, "w") as f:
            for i in range(len(items[0])):
                f.write(json.dumps(merged[i]) + "\n")
    # leave the group in order: every rank past its last transfer, then the engine
    # (whose layers hold the group) freed while the interpreter is whole, then the
    # group destroyed; a group still referenced at interpreter shutdown can abort in
    # gloo's threads as it is freed
    dist.barrier()
    del engine, lockstep
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
