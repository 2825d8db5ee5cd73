"""Both halves of the connector under vLLM's own ``Scheduler``: a fake forward writes each
token's KV (a value that depends on the token's whole prefix) into vLLM's blocks, and before
every forward the KV each scheduled request attends to is checked, cell by cell. vLLM decides
everything else: admissions, prefix-cache hits, chunked prefill, preemption, aborts."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_connector_failures import cpu_attention_layers, model_dir  # noqa: F401 - a fixture

BS = 16
LAYERS = 2
HEADS = 2
HEAD = 16


def kv_value(tokens: list[int], pos: int) -> float:
    """Token ``pos``'s KV: a function of its prefix (an integer bf16 holds exactly)."""
    digest = hashlib.blake2b(str(tokens[: pos + 1]).encode(), digest_size=2).digest()
    return float(1 + int.from_bytes(digest, "big") % 250)


class Engine:
    """vLLM's scheduler with our connector, and one worker-side connector over real tensors."""

    def __init__(self, model: str, root: Path, num_blocks: int, *, prefix_caching: bool = True,
                 batch_tokens: int = 64, max_seqs: int = 4, extra: dict[str, Any] | None = None,
                 async_scheduling: bool = False, policy: str = "fail") -> None:
        from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
                                 set_current_vllm_config)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        extra = {"backend": "file", "backend_options": {"root": str(root)}, "host_pages": 64, **(extra or {})}
        kv = KVTransferConfig(kv_connector="HiCacheConnector", kv_connector_module_path="hicache.integrations.vllm",
                              kv_role="kv_both", kv_connector_extra_config=extra,
                              kv_load_failure_policy=policy)
        self.config = VllmConfig(
            model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=batch_tokens, max_num_seqs=max_seqs,
                                             max_model_len=512, enable_chunked_prefill=True, is_encoder_decoder=False,
                                             async_scheduling=async_scheduling),
            kv_transfer_config=kv,
        )
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(self.names, spec)])
        self.config.cache_config.num_gpu_blocks = num_blocks
        cpu_attention_layers(self.config, self.names, spec)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        with set_current_vllm_config(self.config):
            kind = AsyncScheduler if async_scheduling else Scheduler
            self.scheduler = kind(self.config, kv_config, StructuredOutputManager(self.config), BS)
            self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_config)
        self.caches = {n: torch.zeros(num_blocks, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16) for n in self.names}
        self.worker.register_kv_caches(self.caches)
        self.bad: list[str] = []
        self.in_flight: list[tuple[Any, Any]] = []  # (scheduler output, model output) not handed back yet
        #: tokens sampled by steps not handed back yet: request -> [(step, token)]
        self.sampled: dict[str, list[tuple[int, int]]] = {}
        self.steps = 0
        self.prev_failed: set[int] = set()  # blocks whose load failed in the step before
        #: request -> the step whose forward attended to a failed load's block: with async
        #: scheduling its next step (planned before vLLM knew) attends to what that one computed
        self.doomed: dict[str, int] = {}
        self.async_scheduling = async_scheduling

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.scheduler.add_request(Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                           None, block_hasher=self.hasher))

    def _check(self, req_id: str, tokens: list[int], upto: int, blocks: list[int], skip: set[int]) -> bool:
        """Whether the cells of positions ``[0, upto)`` hold their prefix's KV; a wrong one in a
        block outside ``skip`` (failed loads vLLM knows of) is recorded in ``bad``."""
        clean = True
        for pos in range(upto):
            block = blocks[pos // BS]
            want = kv_value(tokens, pos)
            for name in self.names:
                got = self.caches[name][block, :, pos % BS]
                if not bool((got == want).all()):
                    clean = False
                    if block not in skip and not (self.async_scheduling and self.doomed.get(req_id) == self.steps - 1):
                        self.bad.append(f"{req_id} pos {pos} block {block} {name}: {got.flatten()[0].item()} != {want}")
                        return False
        return clean

    def _write(self, tokens: list[int], blocks: list[int], positions: range, *, clean: bool) -> None:
        """The forward's KV of ``positions``: its prefix's, or a wrong value."""
        for pos in positions:
            for name in self.names:
                self.caches[name][blocks[pos // BS], :, pos % BS] = kv_value(tokens, pos) if clean else 0.5

    def step(self) -> Any:
        """One engine step: schedule, run the worker's side and the fake forward, and hand the
        output back (with async scheduling, the one of the step before: this one is in flight)."""
        out = self.scheduler.schedule()
        self.steps += 1
        self.in_flight.append((self.steps, out, self._execute(out)))
        self.flush(1 if self.async_scheduling else 0)
        return out

    def flush(self, keep: int = 0) -> None:
        """Hand back the outputs of the steps in flight, all but the last ``keep``."""
        while len(self.in_flight) > keep:
            step, done, output = self.in_flight.pop(0)
            for req_id in output.req_ids:
                self.sampled[req_id] = [(s, t) for s, t in self.sampled.get(req_id, []) if s != step]
            self.scheduler.update_from_output(done, output)

    def reset(self, reset_connector: bool = True) -> bool:
        """vLLM's ``reset_prefix_cache`` between two steps (with async scheduling one is in
        flight): running requests are preempted, and their in-flight tokens dropped."""
        ok = self.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=reset_connector)
        self.sampled.clear()
        return bool(ok)

    def _execute(self, out: Any) -> Any:
        from vllm.forward_context import get_forward_context, set_forward_context
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        w = self.worker
        reqs = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        reqs += list(zip(cached.req_ids, cached.num_computed_tokens))
        with set_forward_context(None, self.config):
            w.bind_connector_metadata(out.kv_connector_metadata)
            if out.has_sync_kv_loads:
                w.start_load_kv(get_forward_context())
            for name in self.names:
                w.wait_for_layer_load(name)
            w._worker.finish_step()  # what the layer waits imply: every layer of the load is in
            # a failed load's blocks are attended to in its step, and with async scheduling in the
            # next one too (planned before the failure was known): vLLM rolls those requests back
            failed = set(w._worker._failed) | (self.prev_failed if self.async_scheduling else set())
            # the forward: every request's new tokens' KV goes in first (a layer's KV of the whole
            # batch is written before its attention: a request admitted on a prefix-cache hit of
            # blocks another request of the step computes reads them), then each request's
            # attention reads its cells; KV computed over a wrong cell is wrong too
            sampled: list[list[int]] = []
            views = []
            for req_id, before in reqs:
                request = self.scheduler.requests[req_id]
                tokens = list(request.all_token_ids) + [t for _, t in self.sampled.get(req_id, [])]
                blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
                new = range(before, min(before + out.num_scheduled_tokens[req_id], len(tokens)))
                views.append((req_id, before, tokens, blocks, new))
                self._write(tokens, blocks, new, clean=True)
            for req_id, before, tokens, blocks, new in views:
                clean = self._check(req_id, tokens, before, blocks, failed)
                if not clean:
                    self._write(tokens, blocks, new, clean=False)
                    if self.doomed.get(req_id) != self.steps - 1:
                        self.doomed[req_id] = self.steps
                token = int(kv_value(tokens, len(tokens) - 1)) % 500
                done = new.stop >= len(tokens)
                sampled.append([token] if done else [])
                if done:
                    self.sampled.setdefault(req_id, []).append((self.steps, token))
            if not out.has_sync_kv_loads:
                w.start_load_kv(get_forward_context())
            w.wait_for_save()
            invalid = w.get_block_ids_with_load_errors()
            self.prev_failed = set(invalid)
            meta = w.build_connector_worker_meta()
            w.clear_connector_metadata()
        ids = [req_id for req_id, _ in reqs]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled,
                                 kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid,
                                                                       kv_connector_worker_meta=meta))

    def run(self, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def settle(self) -> None:
        """Empty steps until every storage write was reported."""
        import time

        sched = self.scheduler.connector._scheduler
        for _ in range(200):
            if not sched._writes:
                return
            time.sleep(0.02)
            self.step()
        raise AssertionError("writes never reported")

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def prompts(seed: int, n: int, shared: int) -> list[list[int]]:
    """``n`` prompts of one ``shared``-token prefix and a tail of their own."""
    rng = random.Random(seed)
    base = [rng.randrange(1, 500) for _ in range(shared)]
    return [base + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def drive(e: Engine, tag: str, seed: int, max_tokens: int, rng: random.Random, *, abort: float = 0.0,
          lose: float = 0.0, reset_at: int | None = None) -> None:
    """Eight prompts through the engine, with random aborts, host pages a worker lost (their
    bytes gone; the scheduler's tree still counts them) and a connector reset at step ``reset_at``."""
    from vllm.v1.request import RequestStatus

    for i, p in enumerate(prompts(seed, 8, shared=40)):
        e.add(f"{tag}{i}", p, max_tokens=max_tokens)
    for k in range(800):
        if not e.scheduler.has_unfinished_requests():
            break
        e.step()
        if abort and rng.random() < abort and e.scheduler.requests:
            e.scheduler.finish_requests([rng.choice(list(e.scheduler.requests))], RequestStatus.FINISHED_ABORTED)
        if lose and rng.random() < lose:
            w = e.worker._worker
            with w._lock:
                for slot in rng.sample(range(w.num_pages), 3):
                    if not w._busy(slot):  # (a storage write still reading it would store the loss)
                        w._resident[slot] = None
                        w._page(slot).fill_(7)
        if k == reset_at:
            assert e.reset()
    e.flush()
    assert not e.scheduler.has_unfinished_requests()


def damage_pages(root: Path, rng: random.Random, share: float = 0.25) -> None:
    """Flip a byte in ``share`` of the stored pages."""
    pages = [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > LAYERS * BS * HEADS * 2 * HEAD * 2]
    for page in rng.sample(pages, max(1, int(len(pages) * share))):
        data = bytearray(page.read_bytes())
        data[len(data) // 2] ^= 0x55
        page.write_bytes(bytes(data))


@pytest.mark.parametrize(("async_scheduling", "policy"), [(False, "fail"), (True, "fail"), (False, "recompute")])
def test_under_vllms_scheduler_every_forward_attends_to_its_own_kv(model_dir: str, tmp_path: Path,  # noqa: F811
                                                                 async_scheduling: bool, policy: str) -> None:
    """14 blocks for 8 requests (preemptions), chunked prefill, shared prefixes from the host
    tier, aborts, a connector reset with a step in flight, host pages a worker lost; then a
    second engine over the same store with a quarter of its pages damaged, and a third. Under
    either ``kv_load_failure_policy`` (``recompute`` only without steps in flight: refused
    there) no forward attends to a cell that is not its prefix's KV (a failed load's blocks
    aside, in its step and, with async scheduling, in the next: vLLM fails or rolls back those
    requests), and nothing computed over one is stored."""
    for seed in range(3):
        rng = random.Random(seed)
        root = tmp_path / str(seed)
        kw: dict[str, Any] = {"num_blocks": 14, "extra": {"host_pages": 20}, "async_scheduling": async_scheduling,
                              "policy": policy}
        first = Engine(model_dir, root, **kw)
        try:
            drive(first, "a", seed, 30, rng, abort=0.03, lose=0.2)
            drive(first, "b", seed, 10, rng, abort=0.03, reset_at=3)
            first.settle()
            drive(first, "c", seed, 10, rng)
            assert first.bad == []
            assert first.scheduler.connector._scheduler.stats["host_hit_tokens"] > 0
        finally:
            first.close()
        damage_pages(root, rng)
        for tag in ("d", "e"):
            later = Engine(model_dir, root, **kw)
            try:
                drive(later, tag, seed, 10, rng, lose=0.2 if tag == "d" else 0.0)
                later.settle()
                assert later.bad == []
                assert later.scheduler.connector._scheduler.stats["hit_tokens"] > 0
            finally:
                later.close()


def _store_damaged(model_dir: str, tmp_path: Path, prompt: list[int], **engine: Any) -> None:
    """One engine stores ``prompt``'s pages under ``tmp_path``, then every page is damaged:
    the next engine's loads of them fail."""
    first = Engine(model_dir, tmp_path, **engine)
    try:
        first.add("x0", prompt, max_tokens=2)
        first.run()
        first.settle()
    finally:
        first.close()
    damage_pages(tmp_path, random.Random(0), share=1.0)


def test_a_request_preempted_before_its_failed_load_is_reported_leaves_no_block_in_vllms_cache(
        model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """vLLM caches a step's loaded blocks as computed when it plans the load, and on the
    failure's report evicts them only for the requests running then. With async scheduling the
    next step is planned before that report and may preempt the loading request (vLLM's own
    ``_preempt_request``, as ``schedule`` does when blocks run short): its failed blocks stayed
    in vLLM's prefix cache, and the request resumed, or any request of that prefix, attended
    to them as its KV (and its saves stored what it computed over them)."""
    import time

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    prompt = prompts(7, 1, shared=40)[0]
    _store_damaged(model_dir, tmp_path, prompt, num_blocks=14)
    second = Engine(model_dir, tmp_path, num_blocks=14, async_scheduling=True)
    try:
        second.add("x", prompt, max_tokens=5)
        for _ in range(50):  # the storage lookup may answer "not yet" first
            out = second.step()
            if out.kv_connector_metadata.loads:
                break
        assert out.kv_connector_metadata.loads and second.in_flight  # the load ran; its report is in flight
        sched = second.scheduler
        request = sched.requests["x"]
        sched.running.remove(request)
        sched._preempt_request(request, time.time())
        second.flush()  # the step's report: its blocks failed
        probe = Request("probe", list(prompt), SamplingParams(max_tokens=1), None, block_hasher=second.hasher)
        _, cached = sched.kv_cache_manager.get_computed_blocks(probe)[:2]
        assert cached == 0
    finally:
        second.close()


def test_under_recompute_every_request_sharing_a_failed_block_computes_it_again(
        model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """Two requests of one prefix admitted in one step: the first loads its pages from storage
    (all damaged), the second takes those blocks from vLLM's prefix cache. Under
    ``kv_load_failure_policy: recompute`` vLLM rolls back only the first to the failed blocks
    and leaves the second counting them computed, for the first to recompute; aborted before
    it did, the second attended to the failed load's bytes as its KV in every later step."""
    from vllm.v1.request import RequestStatus

    prompt = prompts(7, 1, shared=40)[0]
    _store_damaged(model_dir, tmp_path, prompt, num_blocks=30, policy="recompute")
    # both lookups answered in the step that admits them (see test_hostile_ids)
    second = Engine(model_dir, tmp_path, num_blocks=30, policy="recompute", batch_tokens=256,
                    extra={"lookup_wait_s": 5.0})
    try:
        second.add("x", prompt, max_tokens=5)
        second.add("y", [*prompt, 3, 4, 5], max_tokens=5)
        for _ in range(50):  # the storage lookup may answer "not yet" first
            out = second.step()
            if out.kv_connector_metadata.loads:
                break
        loaded = {b for load in out.kv_connector_metadata.loads for b in load.block_ids}
        assert out.num_scheduled_tokens.keys() == {"x", "y"}
        assert loaded & set(second.scheduler.kv_cache_manager.get_block_ids("y")[0])  # y shares x's loaded blocks
        second.scheduler.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
        second.run()
        assert second.bad == []
    finally:
        second.close()


def test_blocks_computed_over_a_failed_load_leave_vllms_prefix_cache(model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """A request loads a stored prefix (every page damaged) and computes the rest of its prompt
    in the same step, over the failed load: vLLM caches those blocks (full) under their hashes.
    Under ``kv_load_failure_policy: recompute`` vLLM evicts nothing (the request is to compute
    them again in place) and the connector evicted only the failed blocks; with the request
    aborted before it did, the blocks computed over the failed load stayed cached, and once
    later requests had cached the prefix's blocks again, one of that prompt was served them as
    its KV (and stored what it computed over them)."""
    from vllm.v1.request import RequestStatus

    rng = random.Random(3)
    prefix = [rng.randrange(1, 500) for _ in range(4 * BS)]
    prompt = [*prefix, *(rng.randrange(1, 500) for _ in range(3 * BS))]
    _store_damaged(model_dir, tmp_path, prefix, num_blocks=30, policy="recompute")
    second = Engine(model_dir, tmp_path, num_blocks=30, policy="recompute", batch_tokens=256)
    try:
        second.add("x", prompt, max_tokens=5)
        for _ in range(50):  # the storage lookup may answer "not yet" first
            out = second.step()
            if out.kv_connector_metadata.loads:
                break
        assert out.kv_connector_metadata.loads and out.num_scheduled_tokens["x"] > 2 * BS
        second.scheduler.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)  # before it recomputed
        # each of these caches more of the prefix's blocks again, until one walks the whole chain
        for req_id, tail in (("y", []), ("z", [3, 4, 5]), ("w", [7, 8, 9])):
            second.add(req_id, [*prompt, *tail], max_tokens=2)
            second.run()
        assert second.bad == []
    finally:
        second.close()
