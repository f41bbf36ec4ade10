"""A PROTOCOL STAND-IN for an SGLang 0.5.23 server -- not SGLang.

A real HTTP server on 127.0.0.1 (stdlib `http.server`, one thread per connection) that implements
the `/generate` contract eaglenest's SGLang client relies on, over a transformers target:

  * request validation as strict as SGLang 0.5.23's schema or stricter: top-level keys must be
    GenerateReqInput fields (`prompt_token_ids` is refused: it is a response field only), and
    `sampling_params` keys must be fields of SGLang's SamplingParams contract (which rejects
    unknown keys); batch form with one unique rid per sample, `extra_key` list of the batch size;
    `return_hidden_states` refused (HTTP 400) unless the stand-in plays a hidden-state server;
  * responses: one dict per sample with `output_ids`, `meta_info` (`id`, `prompt_tokens`,
    `completion_tokens`, `cached_tokens`, `finish_reason` as {"type": "stop", "matched": id} or
    {"type": "length", "length": n}), `prompt_token_ids` when `return_prompt_token_ids` is set,
    `meta_info.hidden_states` as a list holding one [T, width] block for the prefill (kinds
    "final" / "aux");
  * kind "plugin": every capture request's prefill runs through eaglenest's capture plugin
    (`Observer.around`) on an SGLang-shaped model (tests/sglang_shapes.py) built from the target's
    weights, so the staging files are the plugin's own output;
  * optional fake speculative metrics (`spec_steps`): `spec_verify_ct`, `spec_num_correct_drafts`,
    `spec_correct_drafts_histogram` with a deterministic acceptance pattern (numbers for the
    evaluator's arithmetic, not a measurement);
  * fault injection: `fail_next` (HTTP statuses to answer next), `delay_next` (seconds to sleep
    before answering), `prompt_tokens_offset` (misreport the prompt length), `context_len`
    (refuse longer prompts with HTTP 400, as SGLang does).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

import sglang_schema as schema
from eaglenest.engines.sglang import plugin
from sglang_shapes import FakeForwardBatch, ForwardMode, ShapedModel

VERSION = schema.VERSION

GENERATE_REQ_INPUT_FIELDS_0_5_23 = schema.GENERATE_REQ_INPUT_FIELDS
SAMPLING_PARAMS_FIELDS_0_5_23 = schema.SAMPLING_PARAMS_FIELDS


class BadRequest(Exception):
    pass


class SGLangStandIn:
    """Protocol stand-in (see module doc).  kind: "plugin" | "final" | "aux" | "plain"."""

    def __init__(self, model_dir, *, kind: str = "plugin", staging=None, layer_ids=None, spec_steps: int | None = None,
                 version: str = VERSION, server_info: dict | None = None):
        from transformers import AutoModelForCausalLM

        self.kind = kind
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.config._attn_implementation = "eager"
        self.shaped = ShapedModel(self.model.model, "llama")
        n = self.model.config.num_hidden_layers
        self.layer_ids = list(layer_ids or plugin.default_layer_ids(n))
        if kind == "aux":  # SGLang's own aux capture: set_eagle3_layers_to_capture(output-of ids) adds 1
            self.shaped.layers_to_capture = list(self.layer_ids)
        self.observer = None
        if kind == "plugin":
            # not SGLang: there is no runtime_context to read a rank from (the real read is tested live)
            self.observer = plugin.Observer(str(staging), layer_ids=layer_ids, sglang_version=version, rank_fn=lambda: 0)
            self.observer.write_marker()
        self.spec_steps = spec_steps
        self.version = version
        self.info = {"version": version, "pp_size": 1, "tp_size": 1, "enable_dp_attention": False,
                     "cuda_graph_config": {"decode": {"backend": "full"}, "prefill": {"backend": "disabled"}},
                     "enable_two_batch_overlap": False, "disable_radix_cache": True,
                     "enable_return_hidden_states": kind in ("final", "aux"),
                     "return_hidden_states_mode": "full" if kind in ("final", "aux") else None}
        if kind == "aux":  # what 0.5.23's /server_info records for --enable-return-aux-hidden-states
            self.info.update({"enable_return_aux_hidden_states": True, "aux_hidden_state_capture": "eagle3",
                              "return_aux_hidden_state_layer_ids": [k - 1 for k in self.layer_ids]})
        self.info.update(server_info or {})
        self.fail_next: list[int] = []
        self.delay_next: list[float] = []
        self.prompt_tokens_offset = 0
        self.context_len: int | None = None  # longer prompts: HTTP 400 with SGLang 0.5.23's message
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = None
        self.thread = None

    # -- server
    def start(self) -> "SGLangStandIn":
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path in ("/health", "/health_generate"):
                    return self._send(200, {})
                if self.path == "/server_info":
                    return self._send(200, standin.info)
                if self.path == "/model_info":
                    return self._send(200, {"model_path": "standin", "is_generation": True})
                self._send(404, {"error": "not found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                if self.path != "/generate":
                    return self._send(404, {"error": "not found"})
                with standin.lock:
                    fail = standin.fail_next.pop(0) if standin.fail_next else None
                    delay = standin.delay_next.pop(0) if standin.delay_next else 0.0
                if delay:
                    time.sleep(delay)
                if fail:
                    return self._send(fail, {"error": {"message": f"stand-in injected HTTP {fail}"}})
                try:
                    body = json.loads(raw)
                    standin.requests.append(body)
                    out = standin.generate(body)
                except BadRequest as e:
                    return self._send(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
                self._send(200, out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join(timeout=10)
            self.httpd = None
        if self.observer is not None:
            self.observer.writer.flush()

    # -- /generate
    @staticmethod
    def validate(body: dict) -> tuple[list[list[int]], list[str], dict, bool]:
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        if "prompt_token_ids" in body:
            raise BadRequest("prompt_token_ids is not a GenerateReqInput field (it is a response field)")
        unknown = sorted(set(body) - set(GENERATE_REQ_INPUT_FIELDS_0_5_23))
        if unknown:
            raise BadRequest(f"unknown GenerateReqInput fields {unknown}")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids cannot be empty.")
        single = isinstance(ids[0], int)
        batch = [ids] if single else ids
        if not all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in batch):
            raise BadRequest("input_ids should be a list of lists for batch processing.")
        rid = body.get("rid")
        rids = [rid] if isinstance(rid, str) else rid
        if not isinstance(rids, list) or len(rids) != len(batch):
            raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rids)) != len(rids):
            raise BadRequest(f"Duplicate request IDs detected within the request: {rids}")
        ek = body.get("extra_key")
        if ek is not None and not single and (not isinstance(ek, list) or len(ek) != len(batch)):
            raise BadRequest("The length of extra_key should be equal to the batch size.")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("one sampling_params dict expected by this stand-in")
        bad = sorted(set(sp) - set(SAMPLING_PARAMS_FIELDS_0_5_23))
        if bad:
            raise BadRequest(f"unknown sampling_params fields {bad}")
        if int(sp.get("max_new_tokens", 128)) < 0:
            raise BadRequest("max_new_tokens must be at least 0")
        return batch, rids, sp, single

    def generate(self, body: dict):
        batch, rids, sp, single = self.validate(body)
        hidden = body.get("return_hidden_states", False)
        if hidden and self.kind not in ("final", "aux"):
            raise BadRequest("The server is not configured to return the hidden states. "
                             "Please set `--enable-return-hidden-states` to enable this feature.")
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for x in batch for t in x):
            raise BadRequest("token id out of range")
        for x in batch:  # TokenizerManager._validate_one_request (0.5.23), without --allow-auto-truncate
            if self.context_len is not None and len(x) >= self.context_len:
                raise BadRequest(f"The input ({len(x)} tokens) is longer than the model's context length "
                                 f"({self.context_len} tokens).")
        max_new = int(sp.get("max_new_tokens", 128))
        with self.lock, torch.no_grad():
            final = self._prefill(batch, rids)
            outs = []
            for k, (ids, rid) in enumerate(zip(batch, rids)):
                out, reason = self._continue(ids, final[k], max_new, sp)
                meta = {"id": rid, "prompt_tokens": len(ids) + self.prompt_tokens_offset, "completion_tokens": len(out),
                        "cached_tokens": 0, "finish_reason": reason, "weight_version": "default"}
                if hidden:
                    meta["hidden_states"] = [final[k]["hidden"].tolist()]
                if self.spec_steps:
                    meta.update(self._spec(len(out)))
                item = {"text": "", "output_ids": out, "meta_info": meta}
                if body.get("return_prompt_token_ids"):
                    item["prompt_token_ids"] = list(ids)
                outs.append(item)
        return outs[0] if single else outs

    def _prefill(self, batch, rids):
        """One packed EXTEND forward of the whole batch through the SGLang-shaped model (and the
        capture plugin in kind "plugin")."""
        ids = torch.tensor([t for x in batch for t in x], dtype=torch.long)
        pos = torch.cat([torch.arange(len(x)) for x in batch])
        fb = FakeForwardBatch(ForwardMode.EXTEND, list(rids), [len(x) for x in batch], [0] * len(batch), ids)
        if self.observer is not None:
            out = self.observer.around(plugin.LLAMA, ShapedModel.forward, self.shaped, ids, pos, fb)
        else:
            out = self.shaped(ids, pos, fb)
        last, aux = (out if isinstance(out, tuple) else (out, None))
        res, a = [], 0
        for x in batch:
            b = a + len(x)
            res.append({"last": last[a:b], "hidden": (aux if self.kind == "aux" else last)[a:b]})
            a = b
        return res

    def _continue(self, ids, pre, max_new, sp):
        if max_new == 0:
            return [], {"type": "length", "length": 0}
        stop = set(sp.get("stop_token_ids") or [])
        temp = float(sp.get("temperature", 1.0))
        logits = self.model.lm_head(pre["last"][-1])
        first = int(logits.argmax()) if temp <= 0 else self._sample(logits, temp, sp.get("sampling_seed"))
        out = [first]
        if first not in stop and max_new > 1:
            kw = dict(max_new_tokens=max_new - 1, do_sample=temp > 0, pad_token_id=0,
                      eos_token_id=sorted(stop) or None)
            if temp > 0:
                torch.manual_seed(int(sp.get("sampling_seed") or 0))
                kw.update(temperature=temp, top_k=0, top_p=1.0)
            seq = torch.tensor([ids + out])
            g = self.model.generate(seq, attention_mask=torch.ones_like(seq), **kw)
            out += g[0, seq.shape[1]:].tolist()
        if out[-1] in stop:
            return out, {"type": "stop", "matched": out[-1]}
        return out, {"type": "length", "length": len(out)}

    @staticmethod
    def _sample(logits, temp, seed):
        g = torch.Generator().manual_seed(int(seed or 0))
        return int(torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=g))

    def _spec(self, completion: int) -> dict:
        """Fake but self-consistent EAGLE metrics: the prefill emits 1 token, then each verify step
        emits 1 + accepted tokens with accepted cycling 2, 0, 1, 3 (capped at spec_steps)."""
        steps = self.spec_steps
        left, ct, hist, correct, pattern = completion - 1, 0, [0] * (steps + 1), 0, [2, 0, 1, 3]
        while left > 0:
            acc = min(pattern[ct % len(pattern)], steps, left - 1)
            hist[acc] += 1
            correct += acc
            left -= acc + 1
            ct += 1
        if ct == 0:
            return {}
        return {"spec_verify_ct": ct, "spec_accept_length": completion / ct, "spec_num_correct_drafts": correct,
                "spec_num_proposed_drafts": ct * steps, "spec_accept_rate": correct / (ct * steps),
                "spec_correct_drafts_histogram": hist}
