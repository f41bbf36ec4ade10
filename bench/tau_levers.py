"""Training levers for the demo's tau, compared at a fixed step budget, on real SmolLM2 features.

    python bench/tau_levers.py proxy --report DEMO_OUT/report.json --out MT_DIR
    python bench/tau_levers.py train NAME --features DEMO_OUT/features [--set '{"batch_tokens": 512}'] [--variant V]
    python bench/tau_levers.py mt RUN_DIR --proxy MT_DIR/features

Each `train` run is the demo's recipe (TTT 3, draft vocabulary 8192, bf16, 1024-token batches,
lr 1e-3, 400 steps of a full cosine) with one change, and reports held-out ShareGPT accuracy.
`mt` scores a run's final checkpoint on an MT-bench proxy: the 80 first-turn prompts followed by
the target's own greedy answers (the `output_ids` of a demo report), captured like training data,
loss mask on the answers.  The draft's teacher-forced accuracy there is meant to predict what the
decoder accepts (an earlier session found it within 0.02 of the decoded tau; that record was
retired in issue 22: re-check it beside a decode before relying on it), at a fraction of the cost
of a speculative decode.

Variants that are not product options live here, as patches, only for the measurement:
  teacher-t0 / teacher-t0.5: soft cross-entropy against the teacher at temperature 0 (its argmax
  as a one-hot) or 0.5 instead of 1; muon: torch.optim.Muon (lr matched to AdamW's update RMS)
  for the 2-D weights of fc and the layer, AdamW for the head and the norms.
Results are appended to bench/results/tau_levers_runs.jsonl (one line per run, with the command,
git commit, date and machine, as bench/common.write_result records them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
RUNS = HERE / "results" / "tau_levers_runs.jsonl"


def _append(rec: dict) -> None:
    from common import git_state, machine

    rec.update(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command=" ".join(["python"] + sys.argv), machine=machine(),
               **git_state())
    RUNS.parent.mkdir(parents=True, exist_ok=True)
    with RUNS.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "machine"}))


def proxy(args) -> None:
    """Prompt ids exactly as the evaluator builds them + the target's greedy output ids, as
    tokenized rows; then the ordinary prepare and capture."""
    from transformers import AutoTokenizer

    from eaglenest.cli import main
    from eaglenest.evaluate.mtbench import load_mtbench
    from eaglenest.evaluate.run import chat_prompt_ids
    from eaglenest.models.fetch import fetch

    model = str(fetch("smollm2"))
    tok = AutoTokenizer.from_pretrained(model)
    report = json.loads(Path(args.report).read_text())
    questions = {p.id: p for p in load_mtbench()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = out / "rows.jsonl"
    with rows.open("w") as f:
        for r in report["per_prompt"]:
            if r["turn"] != 1:
                continue
            ids = chat_prompt_ids(tok, [{"role": "user", "content": questions[r["id"]].turns[0]}])
            f.write(json.dumps({"id": f"mt{r['id']}", "input_ids": ids + r["output_ids"], "loss_mask": [0] * len(ids) + [1] * len(r["output_ids"])}) + "\n")
    main(["prepare", "--model", model, "--data", str(rows), "--out", str(out / "data")])
    main(["capture", "--model", model, "--data", str(out / "data"), "--out", str(out / "features")])


def _teacher_temperature(temp: float) -> None:
    import torch

    from eaglenest.train import ttt

    orig = ttt.Teacher.targets

    def targets(self, last_hidden, chunk=None, argmax=None, mass=False, log_mass=None):
        from eaglenest.train.losses import TeacherRows

        r = orig(self, last_hidden, chunk, argmax, mass, log_mass)
        logp = torch.log_softmax(r.logits.float(), -1)  # softmax(z / T) == softmax(log softmax(z) / T)
        if temp == 0:
            return TeacherRows.from_probs(torch.nn.functional.one_hot(logp.argmax(-1), logp.shape[-1]).float(), r.argmax, r.log_mass)
        return TeacherRows.from_probs(torch.softmax(logp / temp, dim=-1), r.argmax, r.log_mass)

    ttt.Teacher.targets = targets


def _muon(tr, lr: float) -> None:
    import torch

    from eaglenest.train.trainer import lr_lambda

    named = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
    mu = [p for n, p in named if p.ndim == 2 and not n.startswith("lm_head")]
    rest = [p for n, p in named if all(p is not q for q in mu)]
    o1 = torch.optim.Muon(mu, lr=lr, weight_decay=0.0, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    o2 = torch.optim.AdamW(rest, lr=tr.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sch = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_lambda(s, tr.warmup, tr.total_steps, tr.cfg.min_lr_ratio)) for o in (o1, o2)]

    class Both:  # the two optimizers behind the one interface the trainer calls
        def zero_grad(self, set_to_none=True):
            o1.zero_grad(set_to_none=set_to_none)
            o2.zero_grad(set_to_none=set_to_none)

        def step(self):
            o1.step()
            o2.step()

        def state_dict(self):
            return {"muon": o1.state_dict(), "adamw": o2.state_dict()}

    class BothSched:
        def step(self):
            for s in sch:
                s.step()

        def get_last_lr(self):
            return sch[1].get_last_lr()

        def state_dict(self):
            return {}

    tr.opt, tr.sched = Both(), BothSched()


def train(args) -> None:
    import torch

    from eaglenest.models.fetch import fetch
    from eaglenest.train.trainer import Trainer, TrainConfig

    torch.set_num_threads(args.threads)
    kw = dict(ttt_steps=3, draft_vocab=8192, lr=1e-3, max_steps=400, batch_tokens=1024, freeze_head=False, eval_fraction=0.05,
              eval_max_batches=40, dtype="bf16", eval_every=100)
    kw.update(json.loads(args.set))
    out = Path(args.out_root) / args.name
    v = args.variant
    if v.startswith("teacher-t"):
        _teacher_temperature(float(v[len("teacher-t"):]))
    t0 = time.time()
    tr = Trainer(TrainConfig(model=str(fetch("smollm2")), features=args.features, out=str(out), **kw))
    if v == "muon":
        _muon(tr, args.muon_lr)
    ev = tr.fit()["eval"]
    _append({"kind": "train", "name": args.name, "variant": v, "config": kw, "wall_s": round(time.time() - t0, 1), "run": str(out),
             "heldout_acc": [round(a, 4) for a in ev["acc"]], "heldout_expected_tau": round(ev["expected_tau"][-1], 4)})


def mt(args) -> None:
    """Teacher-forced accuracy of RUN's final checkpoint on the proxy store (the run's own vocabulary)."""
    import torch

    torch.set_num_threads(args.threads)
    ev = proxy_eval(Path(args.run), args.proxy, Path(args.out_root) / f"_mt_{Path(args.run).name}")
    _append({"kind": "mt_proxy", "run": str(args.run), "mt_acc": [round(a, 4) for a in ev["acc"]], "mt_expected_tau": round(ev["expected_tau"][-1], 4)})


def proxy_eval(run: Path, proxy_features, tmp: Path) -> dict:
    """The held-out evaluation (Trainer.evaluate: accuracy, alpha, predicted tau) of RUN's final
    checkpoint over every sample of a proxy store; `n_samples` added."""
    import torch

    from eaglenest.train.data import Schedule
    from eaglenest.train.trainer import Trainer, TrainConfig

    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "checkpoints").mkdir(parents=True)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    shutil.copy(run / "vocab.safetensors", tmp)
    shutil.copy(run / "checkpoints" / "latest.json", tmp / "checkpoints")
    shutil.copytree(run / "checkpoints" / latest["dir"], tmp / "checkpoints" / latest["dir"])
    c = json.loads((run / "config.json").read_text())["train"]
    # resume = the run's vocabulary and weights; its optimizer state is not needed (and a Muon run's does not fit AdamW)
    torch.optim.AdamW.load_state_dict = lambda self, sd: None
    torch.optim.lr_scheduler.LambdaLR.load_state_dict = lambda self, sd: None
    tr = Trainer(TrainConfig(model=c["model"], features=str(proxy_features), out=str(tmp), ttt_steps=c["ttt_steps"],
                             draft_vocab=c["draft_vocab"], eval_fraction=0.5, dtype=c["dtype"], resume=True,
                             serve_steps=c.get("serve_steps", 3)))
    st = tr.store
    tr.eval_batches = Schedule(st.lengths(), list(range(len(st))), 1024, 1, 0, 2048).batches  # every proxy sample
    ev = tr.evaluate()
    shutil.rmtree(tmp, ignore_errors=True)
    return {**ev, "n_samples": len(st)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("proxy")
    p.add_argument("--report", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("train")
    p.add_argument("name")
    p.add_argument("--features", required=True)
    p.add_argument("--set", default="{}", help="TrainConfig fields to change, as JSON")
    p.add_argument("--variant", default="base", choices=["base", "teacher-t0", "teacher-t0.5", "muon"])
    p.add_argument("--muon-lr", type=float, default=1e-3)
    p = sub.add_parser("mt")
    p.add_argument("run")
    p.add_argument("--proxy", required=True, help="the proxy's features directory")
    for p in sub.choices.values():
        p.add_argument("--out-root", default=os.environ.get("TMPDIR", "/tmp") + "/tau_levers")
        p.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    {"proxy": proxy, "train": train, "mt": mt}[args.cmd](args)


if __name__ == "__main__":
    main()
