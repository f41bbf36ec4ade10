"""Helpers for the vLLM tests: skip reason, a fake OpenAI-style server, tiny data and drafts."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def vllm_python() -> Path | None:
    p = Path(os.environ.get("EAGLENEST_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
    return p if p.exists() else None


requires_vllm = pytest.mark.skipif(
    vllm_python() is None,
    reason="vLLM environment missing (.venv-vllm): run `bash scripts/setup_vllm.sh` (CI does)",
)


class FakeVLLM:
    """A tiny stand-in for vLLM's /v1/completions on 127.0.0.1, for protocol tests.

    `handler(payload) -> (status, body_dict)` decides each completion answer; /v1/models and
    /health answer like vLLM.
    """

    def __init__(self, handler):
        outer = self
        self.handler = handler
        self.requests: list[dict] = []

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, status: int, body: dict | str):
                data = (json.dumps(body) if not isinstance(body, str) else body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "fake-model", "max_model_len": 4096}]})
                elif self.path == "/health":
                    self._send(200, {})
                elif self.path == "/metrics":
                    self._send(200, "# metrics\n")
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                payload = json.loads(self.rfile.read(n) or b"{}")
                outer.requests.append(payload)
                status, body = outer.handler(payload)
                self._send(status, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(prompt_ids, token_ids=(0,), finish="length", stop_reason=None, hidden_states_path=None) -> dict:
    body = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": "fake-model",
        "choices": [{"index": 0, "text": "", "finish_reason": finish, "stop_reason": stop_reason,
                     "token_ids": list(token_ids), "prompt_token_ids": list(prompt_ids)}],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids)},
        "system_fingerprint": "vllm-fake",
    }
    if hidden_states_path:
        body["kv_transfer_params"] = {"hidden_states_path": str(hidden_states_path)}
    return body


@contextlib.contextmanager
def capture_server(model, dtype: str = "bf16"):
    """The URL of a vLLM server started for capture (the engine object only starts and stops it)."""
    from eaglenest.engines.vllm import VLLMEngine

    e = VLLMEngine(str(model), dtype=dtype)
    try:
        e.start("capture")
        yield e.server.url
    finally:
        e.close()


def make_tiny_data(out: Path, model: str = "smollm2", n: int = 4, max_length: int = 256) -> Path:
    """A prepared DATA_DIR with the first n ShareGPT conversations (real SmolLM2 template)."""
    from eaglenest.data import prepare

    if not (out / "meta.json").exists():
        prepare(model=model, data=["sharegpt:40"], out=out, max_length=max_length, limit=n, verbose=False)
    return out


def make_random_draft(out: Path, target_dir: Path, draft_vocab: int = 4096, seed: int = 0) -> Path:
    """A random-init draft for the target, exported in the portable format (acceptance ~0)."""
    import torch
    from transformers import AutoConfig

    from eaglenest.capture.layers import default_layer_ids
    from eaglenest.draft.model import Eagle3Config, Eagle3Draft
    from eaglenest.draft.vocab import build_vocab
    from eaglenest.export.format import save_draft

    t = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(t, draft_vocab_size=draft_vocab, aux_layer_ids=default_layer_ids(t.num_hidden_layers))
    d = Eagle3Draft(cfg)
    d2t, t2d = build_vocab(torch.zeros(t.vocab_size), draft_vocab, always=[int(t.eos_token_id)])
    d.set_vocab(d2t, t2d)
    return save_draft(d, out)


def make_echo_target(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny Llama whose decoder layers add nothing (o_proj and down_proj zero): every layer's state
    and the final one are the token's own embedding, and the tied head then picks that token again
    (a 64-wide random embedding is closest to itself), so greedy decoding repeats the last prompt
    token.  head_dim 32: vLLM's CPU attention takes no smaller head."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=32, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def make_oracle_draft(out: Path, echo_target: Path, draft_vocab: int = 4096) -> Path:
    """An EAGLE-3 draft that is always right about make_echo_target's target: fc keeps the first
    captured layer's state (the last token's embedding), its layer adds nothing, and lm_head is the
    target's embeddings over a draft vocabulary holding the tokens a chat prompt ends with (so the
    served d2t offsets matter), so it proposes the token it was given, as the target decodes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from eaglenest.capture.layers import default_layer_ids
    from eaglenest.draft.model import Eagle3Config, Eagle3Draft
    from eaglenest.draft.vocab import build_vocab
    from eaglenest.evaluate.run import chat_prompt_ids
    from eaglenest.export.format import save_draft

    t = AutoConfig.from_pretrained(echo_target)
    embed = AutoModelForCausalLM.from_pretrained(echo_target).get_input_embeddings().weight.detach()
    last = chat_prompt_ids(AutoTokenizer.from_pretrained(echo_target), [{"role": "user", "content": "?"}])[-1]
    d = Eagle3Draft(Eagle3Config.from_target(t, draft_vocab_size=draft_vocab, aux_layer_ids=default_layer_ids(t.num_hidden_layers)),
                    embed_weight=embed)
    # the highest ids and the two needed: `last` sits at draft index 1, an offset only d2t undoes
    d2t, t2d = build_vocab(torch.arange(t.vocab_size), draft_vocab, always=[int(t.eos_token_id), last])
    d.set_vocab(d2t, t2d)
    H = t.hidden_size
    with torch.no_grad():
        d.fc.weight.zero_()
        d.fc.weight[:, :H] = torch.eye(H)
        d.midlayer.self_attn.o_proj.weight.zero_()
        d.midlayer.mlp.down_proj.weight.zero_()
        d.lm_head.weight.copy_(embed[torch.arange(draft_vocab) + d2t])
    return save_draft(d, out)


def compare_features(vllm_store: Path, hf_store: Path, model_dir: Path, dtype: str) -> dict:
    """Per-layer cosine (per token) and teacher-distribution agreement between a vLLM-captured
    store (final state pre-norm) and an HF-captured one (post-norm), sample by sample."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from eaglenest.features import FeatureStore

    v, h = FeatureStore(vllm_store), FeatureStore(hf_store)
    assert v.meta.final_norm == "pre" and h.meta.final_norm == "post"
    assert v.meta.layer_ids == h.meta.layer_ids
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).eval()
    H = v.meta.hidden_size
    hidx = {sid: i for i, sid in enumerate(h.ids())}
    cos = [[] for _ in v.meta.layer_ids]
    kl, maxdiff, agree = [], [], []
    ids_equal = True
    for i, sid in enumerate(v.ids()):
        a, b = v[i], h[hidx[sid]]
        ids_equal &= torch.equal(a["input_ids"], b["input_ids"])
        for k in range(len(cos)):
            sl = slice(k * H, (k + 1) * H)
            cos[k].append(F.cosine_similarity(a["aux_hidden_states"][:, sl].float(), b["aux_hidden_states"][:, sl].float(), dim=-1))
        with torch.no_grad():
            lv = m.lm_head(m.model.norm(a["last_hidden_state"].to(tdtype))).float()  # pre-norm -> norm -> head
            lh = m.lm_head(b["last_hidden_state"].to(tdtype)).float()  # post-norm -> head
        pv, ph = lv.softmax(-1), lh.softmax(-1)
        kl.append((ph * (ph.clamp_min(1e-30).log() - pv.clamp_min(1e-30).log())).sum(-1))
        maxdiff.append((pv - ph).abs().amax(-1))
        agree.append((lv.argmax(-1) == lh.argmax(-1)).float())
    cos_t = [torch.cat(c) for c in cos]
    kl_t, md_t, ag_t = torch.cat(kl), torch.cat(maxdiff), torch.cat(agree)
    return {
        "samples": len(v),
        "tokens": int(kl_t.numel()),
        "ids_equal": bool(ids_equal),
        "layer_ids": list(v.meta.layer_ids),
        "cos_min": [float(c.min()) for c in cos_t],
        "cos_mean": [float(c.mean()) for c in cos_t],
        "cos_frac_ge_0.999": [float((c >= 0.999).float().mean()) for c in cos_t],
        "teacher_kl_mean": float(kl_t.mean()),
        "teacher_kl_max": float(kl_t.max()),
        "teacher_prob_maxdiff": float(md_t.max()),
        "teacher_argmax_agree": float(ag_t.mean()),
    }
