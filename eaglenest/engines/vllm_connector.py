"""A CPU-capable hidden-states KV connector for vLLM's `extract_hidden_states` method.

vLLM (0.32) ships `ExampleHiddenStatesConnector`
(vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py): after a
request finishes it copies the request's slots out of the cache-only "KV cache" that holds the
captured hidden states, and a thread writes them to `<shared_storage_path>/<req_id>.safetensors`
(`hidden_states [T, L, H]`, `token_ids [T]`) while holding an exclusive flock on
`<file>.lock`.  Its `_submit_async_write` uses two CUDA-only calls -- a side CUDA stream/event
pair and *pinned* host memory for the device-to-host copy -- so it fails on a CPU server.

`CPUHiddenStatesConnector` overrides only that method: on a CPU KV cache it gathers the slots
into ordinary memory synchronously (a copy; the blocks are freed after `get_finished` reports the
request done) and hands the write to the same thread pool with an already-completed "event".
On a CUDA cache it defers to the stock implementation unchanged.  Everything else (lock files,
paths in `kv_transfer_params.hidden_states_path`, block bookkeeping) is vLLM's own code.

vLLM loads it by module path, in its worker processes:

    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
                           "kv_connector_module_path": "eaglenest.engines.vllm_connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": DIR}}'

with PYTHONPATH pointing at the eaglenest checkout (the vLLM venv does not install eaglenest).
Importing this module is cheap and needs neither vLLM nor torch: the class is built on first
attribute access (PEP 562 `__getattr__`, which is what vLLM's `getattr(module, name)` triggers),
so engine discovery in the main venv can import it without pulling vLLM in.
"""

from __future__ import annotations

CONNECTOR_NAME = "CPUHiddenStatesConnector"
MODULE_PATH = __name__

__all__ = [CONNECTOR_NAME, "CONNECTOR_NAME", "MODULE_PATH"]


class _Completed:
    """Stands in for the torch.cuda.Event the stock connector records: the CPU copy is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _build():
    import fcntl
    import os
    from functools import partial

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        PendingSave,
        extract_from_kv_cache,
    )

    class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
        """ExampleHiddenStatesConnector without pinned memory and CUDA events on a CPU KV cache."""

        def _submit_async_write(self, pending: PendingSave) -> None:
            if not self._is_tp_rank_zero:
                return
            assert self._kv_cache is not None
            if self._kv_cache.is_cuda:
                return super()._submit_async_write(pending)

            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
            num_tokens = pending.token_ids.shape[0]
            # advanced indexing returns a fresh tensor: the data no longer aliases the cache blocks
            hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).contiguous()
            tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

            assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
            os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            done = _Completed()
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
            self._req_copy_events[pending.req_id] = done
            self._req_futures[pending.req_id] = future
            future.add_done_callback(partial(self._on_write_done, pending.req_id))

    CPUHiddenStatesConnector.__module__ = __name__
    return CPUHiddenStatesConnector


def __getattr__(name: str):
    if name == CONNECTOR_NAME:
        cls = _build()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
