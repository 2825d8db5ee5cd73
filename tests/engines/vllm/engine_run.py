"""One vLLM engine, in its own process: ``python engine_run.py SPEC.json``.

The spec names the model, the connector config (or none), the prompts (token ids) and where to
write the result: every prompt's generated token ids, how many prompt tokens vLLM reported
as cached and, with ``logprobs``: N, the logprobs of the N most likely tokens at every step.
Optional ``phases`` run prompt groups one after the other with a file barrier in between (two
engines sharing one store), and ``reset_before`` resets vLLM's prefix cache and the
connector's before a phase. Used by the end-to-end tests and the benchmark.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier file {path} did not appear in {timeout} s")
        time.sleep(0.2)


def _only_kernel_blocks(size: int) -> None:
    """Make vLLM's CPU attention backend take only ``size``-token kernel blocks, as FlashInfer
    takes only 16/32/64 on a GPU: vLLM then splits every larger block into kernel blocks
    (``prepare_kernel_block_sizes``). The CPU kernels run any multiple of 32 tokens, so the
    engine generates the same text either way; only its KV cache tensors and block tables are in
    kernel blocks. Needs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(lambda kv_cache_spec=None: [size])  # type: ignore[method-assign]


def main(spec_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    for p in spec.get("sys_path", []):
        sys.path.insert(0, p)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    if spec.get("kernel_block_size"):
        _only_kernel_blocks(int(spec["kernel_block_size"]))
    kwargs: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks_override"])
    t0 = time.monotonic()
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=spec.get("max_model_len", 2048),
        block_size=spec.get("block_size", 32), enforce_eager=True, seed=0, max_num_seqs=spec.get("max_num_seqs", 8),
        enable_prefix_caching=spec.get("prefix_caching", True),
        distributed_executor_backend=None if spec.get("multiprocess") else "uni", **kwargs,
    )
    started = time.monotonic() - t0
    logprobs = spec.get("logprobs")  # the top ones at each step, with the chosen token's
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0.0, ignore_eos=True, detokenize=False,
                        logprobs=logprobs)
    phases = spec.get("phases") or [{"prompts": spec["prompts"]}]
    results = []
    for phase in phases:
        if phase.get("wait_for"):
            _wait_for(phase["wait_for"], spec.get("barrier_timeout", 240))
        reset = None
        if phase.get("reset_before"):  # what a weight update does: every cache, the connector's too
            reset = bool(llm.reset_prefix_cache(reset_connector=True))
        t = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]], sp, use_tqdm=False)
        results.append({
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []]
                         for o in outs] if logprobs else None,
            "cached": [int(o.num_cached_tokens or 0) for o in outs],
            "seconds": time.monotonic() - t,
            "reset": reset,
        })
        if phase.get("signal"):
            Path(phase["signal"]).write_text("done")
    Path(spec["out"]).write_text(json.dumps({"startup_s": started, "phases": results}))
    del llm


if __name__ == "__main__":
    main(sys.argv[1])
