"""SGLang 0.5.23's native `/generate` as this client speaks it (`GenerateReqInput`,
sglang/srt/managers/io_struct.py): request bodies and the checks every response goes through.

Always the batch form -- `input_ids` as a list of lists, `rid` and `extra_key` as lists of unique
strings (a unique `extra_key` isolates each sample's radix-cache namespace, so every prompt is
fully prefilled), `sampling_params` one dict, `return_prompt_token_ids: true` (the response then
echoes the prompt ids under the top-level `prompt_token_ids`), and `return_hidden_states: true`
where the mode uses it.  `prompt_token_ids` is never sent: it is a response field only.  Every
response is checked: `meta_info.id` must be the rid sent, `meta_info.prompt_tokens` must equal the
number of ids sent and the echoed `prompt_token_ids` must equal them (else `token_mismatch`).
"""

from __future__ import annotations

from eaglenest.engines.base import Failure, Generated, check_echo
from eaglenest.engines.http import RequestFailed
from eaglenest.engines.sglang import plugin

TARGET_SGLANG_VERSION = plugin.TARGET_SGLANG_VERSION
CAPTURE_RID_PREFIX = plugin.DEFAULT_RID_PREFIX  # the plugin only observes rids with this prefix
GENERATE_RID_PREFIX = "eaglenest-gen-"
# stock-mode capture: not the plugin's prefix, so a server that also runs the plugin writes no
# staging files for these requests (nobody would collect them)
STOCK_RID_PREFIX = "eaglenest-stock-"
CAPTURE_MAX_NEW_TOKENS = 1  # 0 also prefills on 0.5.23 (Req.is_prefill_only), 1 works on every version

# the GenerateReqInput fields this client sends (all present in SGLang 0.5.23)
REQUEST_FIELDS = ("input_ids", "sampling_params", "rid", "extra_key", "return_hidden_states", "return_prompt_token_ids")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "stop_token_ids", "skip_special_tokens", "sampling_seed")


def generate_payload(ids: list[list[int]], rids: list[str], sampling: dict, *, extra_keys: list[str] | None = None,
                     return_hidden_states: bool = False) -> dict:
    """A batched `/generate` body (field names exactly as in GenerateReqInput, SGLang 0.5.23)."""
    if not ids or len(ids) != len(rids) or len(set(rids)) != len(rids):
        raise ValueError("one unique rid per sample")
    body = {"input_ids": [list(map(int, x)) for x in ids], "rid": list(rids), "sampling_params": dict(sampling),
            "return_prompt_token_ids": True}
    if extra_keys is not None:
        if len(extra_keys) != len(ids):
            raise ValueError("one extra_key per sample")
        body["extra_key"] = list(extra_keys)
    if return_hidden_states:
        body["return_hidden_states"] = True
    return body


def capture_sampling() -> dict:
    return {"max_new_tokens": CAPTURE_MAX_NEW_TOKENS, "temperature": 0.0}


def generate_sampling(max_new_tokens: int, temperature: float, seed: int, stop_ids: list[int]) -> dict:
    s = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "top_p": 1.0,
         "skip_special_tokens": False}
    if stop_ids:
        s["stop_token_ids"] = [int(t) for t in stop_ids]
    if temperature > 0:
        s["sampling_seed"] = int(seed)
    return s


def response_items(resp, n: int) -> list[dict]:
    """The per-sample outputs of a batched /generate (a list, in request order)."""
    if isinstance(resp, dict):
        resp = [resp]
    if not isinstance(resp, list) or len(resp) != n or not all(isinstance(x, dict) for x in resp):
        raise RequestFailed("bad_response", f"expected a list of {n} outputs, got {type(resp).__name__}"
                            f"{f' of {len(resp)}' if isinstance(resp, list) else ''}")
    return resp


def check_item(item: dict, rid: str, sent: list[int], sid: str) -> Failure | None:
    """The server must report this rid and exactly the prompt that was sent."""
    meta = item.get("meta_info") or {}
    if meta.get("id") not in (None, rid):
        return Failure(sid, "bad_response", f"response is for request {meta.get('id')!r}, expected {rid!r}")
    fr = meta.get("finish_reason")
    if isinstance(fr, dict) and fr.get("type") == "abort":
        return Failure(sid, "aborted", f"server aborted the request: {fr.get('message')}")
    pt = meta.get("prompt_tokens")
    if pt is None:
        return Failure(sid, "bad_response", "meta_info has no prompt_tokens")
    if int(pt) != len(sent):
        return Failure(sid, "token_mismatch", f"server reports {pt} prompt tokens, {len(sent)} were sent")
    echoed = item.get("prompt_token_ids")
    if echoed is not None and (bad := check_echo(sent, echoed, sid)) is not None:
        return bad
    return None


def hidden_rows(item: dict):
    """`meta_info.hidden_states` of a stock server -> float32 tensor [rows, width].  0.5.23 appends
    one 2-D block [n, H] per prefill chunk, then one row per generated token."""
    import torch

    hs = (item.get("meta_info") or {}).get("hidden_states")
    if not hs:
        return None
    blocks = []
    for el in hs:
        if el and isinstance(el[0], (list, tuple)):
            blocks.append(torch.tensor(el, dtype=torch.float32))
    return torch.cat(blocks, 0) if blocks else None


def finish(sid: str, prompt: list[int], item: dict, eos_ids: list[int]) -> Generated | Failure:
    out = [int(t) for t in (item.get("output_ids") or [])]
    fr = (item.get("meta_info") or {}).get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "abort":
        return Failure(sid, "aborted", f"server aborted the request: {fr.get('message') if isinstance(fr, dict) else fr}")
    if kind == "stop":
        matched = fr.get("matched") if isinstance(fr, dict) else None
        tok = matched if isinstance(matched, int) else (eos_ids[0] if eos_ids else None)
        if tok is not None and (not out or out[-1] not in set(eos_ids) | {tok}):
            out.append(tok)  # a turn ended by a stop token always ends with it
        return Generated(sid, list(prompt), out, "stop")
    return Generated(sid, list(prompt), out, "length")

