"""``formcast serve``: load a model and serve it over the OpenAI API until interrupted."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import typer

log = logging.getLogger("formcast.server")

QUANTIZATIONS = ("none", "auto", "int4", "int8", "gguf")
DTYPES = ("float32", "bfloat16", "float16")


def serve_command(
    model: Annotated[str, typer.Option("--model", "-m",
                                       help="Registry name, .gguf file or HF folder.")] = "smollm2",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    api_key: Annotated[str | None, typer.Option(
        envvar="FORMCAST_API_KEY", help="Clients must send it as a bearer token.")] = None,
    max_concurrency: Annotated[int, typer.Option(
        min=1, help="Requests in flight at once; more are answered 429.")] = 256,
    served_model_name: Annotated[str | None, typer.Option(
        help="The model name clients use (default: --model).")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")] = None,
    quantization: Annotated[str | None, typer.Option(
        help="Weights: none, auto (int4 for a Q4 GGUF on the CPU), int4, int8 or gguf (the "
             "file's own blocks).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(
        min=1, help="Most requests in one engine batch.")] = None,
    max_model_len: Annotated[int | None, typer.Option(min=16, help="Context length.")] = None,
    num_kv_blocks: Annotated[int | None, typer.Option(min=1, help="KV-cache blocks.")] = None,
    num_threads: Annotated[int | None, typer.Option(min=1, help="CPU threads.")] = None,
    spec: Annotated[str | None, typer.Option(
        help="Speculative decoding: auto, prompt_lookup or none.")] = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (chat/completions, completions,
    models, health, metrics), with response_format, tools and streaming."""
    if dtype is not None and dtype not in DTYPES:
        raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(DTYPES)}",
                                 param_hint="--dtype")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise typer.BadParameter(f"{quantization!r} is not one of {', '.join(QUANTIZATIONS)}",
                                 param_hint="--quantization")
    try:  # (before the model loads: a missing extra fails at once)
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise typer.BadParameter(f"formcast serve needs the serve extra ({exc.name} is "
                                 "missing): pip install 'formcast[serve]'") from None
    import torch

    import formcast
    from formcast.server.launch import serve

    options: dict[str, Any] = {"device": device,
                               "dtype": getattr(torch, dtype) if dtype else None}
    if quantization is not None:
        options["quantization"] = None if quantization == "none" else quantization
    engine = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                  num_kv_blocks=num_kv_blocks, num_threads=num_threads, spec=spec)
    options.update({k: v for k, v in engine.items() if v is not None})
    log.info("loading %s", model)
    llm = formcast.AsyncLLM.load(model, max_pending=max_concurrency, **options)
    name = served_model_name or model
    typer.echo(f"serving {name} on http://{host}:{port}/v1 (Ctrl-C stops)", err=True)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    serve(llm, model_name=name, host=host, port=port, api_key=api_key,
          log_level=level if level in ("debug", "info", "warning", "error", "critical")
          else "info")
