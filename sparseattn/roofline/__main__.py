"""``python -m sparseattn.roofline <command>``.

* ``ceilings [--out DIR]`` (GPU): measure this GPU's ceilings; write ``DIR/ceilings-<gpu>.json`` (the packaged
  record with its ``ceilings`` replaced by the measured values).
* ``check [--out DIR] [--n 8192,...]`` (GPU, one run of a few minutes): the ceilings, then predicted vs
  measured times of ours, FlexAttention and cuDNN on the recorded patterns (forward and backward) and on
  decode, and a profile of one training step and one decode step; writes ``DIR/roofline-check-<gpu>.json``
  (bench rows with ``predicted_ms`` beside ``ms``) as it goes.
* ``calibrate [--bench DIR] [--out FILE]`` (CPU, about two minutes): refit the model on the recorded bench files
  and rewrite the record (default: the packaged ``sparseattn/data/ceilings-h200.json``, and then the accuracy
  tables of the package docstring too); ``crossover-h200.json``, when recorded, is evaluated, never fitted.
* ``accuracy``: the accuracy of the packaged model on its evaluation points.
* ``report PATTERN --n N [--pass fwd|bwd]`` / ``crossover FAMILY [--pass fwd|bwd]``: predictions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import torch


def _record_with(ceil) -> dict:
    from .ceilings import device_slug, load_record
    try:
        rec = json.loads(json.dumps(load_record(device_slug(ceil.device))))
    except FileNotFoundError:
        rec = json.loads(json.dumps(load_record("h200")))
        rec["about"] = f"measured on {ceil.device}; model and calibration copied from the H200 record"
    rec["device"] = ceil.device
    rec["ceilings"] = ceil.to_json()
    return rec


def cmd_ceilings(args) -> int:
    from .ceilings import device_slug, measure_ceilings
    if not torch.cuda.is_available():
        print("measuring ceilings needs a CUDA GPU", file=sys.stderr)
        return 2
    c = measure_ceilings()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ceilings-{device_slug(c.device)}.json"
    path.write_text(json.dumps(_record_with(c), indent=1) + "\n")
    print(json.dumps(c.to_json(), indent=1))
    print(f"wrote {path}")
    return 0


def cmd_check(args) -> int:
    from .ceilings import device_slug, measure_ceilings
    if not torch.cuda.is_available():
        print("the check needs a CUDA GPU", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    c = measure_ceilings()
    (out / f"ceilings-{device_slug(c.device)}.json").write_text(json.dumps(_record_with(c), indent=1) + "\n")
    print(json.dumps(c.to_json(), indent=1), flush=True)
    doc = run_check(out, [int(x) for x in args.n.split(",")], args.patterns.split(","), c)
    rows = [x for x in doc["results"] if x["ms"] and x["predicted_ms"]]
    within = sum(abs(x["predicted_ms"] / x["ms"] - 1) <= 0.25 for x in rows)
    print(f"\npredicted/measured on {len(rows)} rows: {within} within +-25%; wrote {doc['path']}")
    return 0


def run_check(out: pathlib.Path, Ns, patterns, ceil, *, device="cuda", timer=None,
              impls=("sparseattn", "flex", "cudnn"), prefill_shape=None, decode_shape=None,
              keeps=(0.05, 0.2, None), profiles: bool = True) -> dict:
    """Predicted (the packaged H200 model) and measured times on the recorded patterns at lengths ``Ns``
    (forward and backward) and on decode; written to ``out/roofline-check-<gpu>.json`` after every case, so
    a run cut short keeps what it measured. ``device``/``timer``/``impls`` let a CPU test walk it."""
    from .calibrate import RECORDED_PATTERNS
    from .ceilings import device_slug
    from .counts import Shape
    from .crossover import DECODE_SHAPE, report
    from .measure import measure_decode, measure_prefill
    prefill_shape = prefill_shape or Shape(B=1, Hq=16, D=128, dtype=torch.bfloat16)
    decode_shape = decode_shape or DECODE_SHAPE
    path = out / f"roofline-check-{device_slug(ceil.device)}.json"
    doc = {"suite": "roofline-check", "device": ceil.device, "date": datetime.datetime.now(datetime.timezone.utc)
           .isoformat(timespec="seconds"), "torch": torch.__version__, "ceilings": ceil.to_json(), "results": [],
           "profiles": {}, "path": str(path)}
    s = prefill_shape
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[s.dtype]

    def save():
        path.write_text(json.dumps(doc, indent=1) + "\n")

    for N in Ns:
        for pattern in patterns:
            for pass_ in ("fwd", "bwd"):
                t0 = time.time()
                try:
                    layout = RECORDED_PATTERNS[pattern](N)
                    r = report(layout, s, pass_=pass_)
                    r.measured.update(measure_prefill(layout, s, pass_, r.envelope, device=device, timer=timer,
                                                      impls=impls))
                except Exception as e:  # keep going: one failing case must not lose the others
                    print(f"# {pattern} N={N} {pass_}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                for impl in impls:
                    case = {"pattern": pattern if impl != "cudnn" else r.envelope, "N": N, "B": s.B, "H": s.Hq,
                            "Hkv": s.Hkv, "D": s.D, "dtype": dtype}
                    doc["results"].append({"case": case, "impl": impl, "pass": pass_, "ms": r.measured[impl],
                                           "predicted_ms": r.predicted[impl]})
                print(f"{r}\n  ({time.time() - t0:.0f} s)", flush=True)
                save()
    d = decode_shape
    for keep in keeps:
        try:
            r = report(None, d, pass_="decode", keep=keep)
            r.measured.update(measure_decode(d, keep, device=device, timer=timer, graph=device != "cpu"))
        except Exception as e:
            print(f"# decode keep={keep}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        case = {"pattern": "dense" if keep is None else f"keep{keep:.2f}", "N": d.seq_len, "B": d.B, "Hq": d.Hq,
                "Hkv": d.Hkv, "D": d.D, "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16",
                                                  torch.float32: "fp32"}[d.dtype], "page_size": d.page_size}
        if keep is not None:
            case["keep"] = keep
        doc["results"].append({"case": case, "impl": "sparseattn", "pass": "decode (CUDA graph)",
                               "ms": r.measured["sparseattn"], "predicted_ms": r.predicted["sparseattn"]})
        doc["results"].append({"case": case, "impl": "cudnn", "pass": "decode dense", "ms": r.measured["cudnn"],
                               "predicted_ms": r.predicted["cudnn"]})
        print(r, flush=True)
        save()
    if profiles:
        try:
            doc["profiles"] = _profiles()
        except Exception as e:
            print(f"# profiles: {type(e).__name__}: {str(e)[:200]}", flush=True)
    save()
    return doc


def _profiles() -> dict:
    """The book's two example steps (:func:`.profile.example_steps`), profiled on the GPU."""
    from .profile import example_steps, profile_step
    out = {}
    for name, (fn, what) in example_steps("cuda").items():
        prof = profile_step(fn)
        print(f"{name}: {what}\n{prof}", flush=True)
        out[name] = {"what": what, **prof.as_dict()}
    return out


def cmd_calibrate(args) -> int:
    from .calibrate import run, summary_table, sync_docstring
    rec = run(args.bench, pathlib.Path(args.out) if args.out else None, iters=args.iters)
    if not args.out and sync_docstring(rec["calibration"]["accuracy"]):
        print("rewrote the accuracy tables of sparseattn/roofline/__init__.py")
    for key, m in rec["model"].items():
        print(f"{key:24s} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in m["params"].items()))
    print()
    print(summary_table(rec["calibration"]["accuracy"]))
    return 0


def cmd_repredict(args) -> int:
    """Rewrite the ``predicted_ms`` of the crossover sweep's rows from the packaged record's predictions (the
    rows the calibration prices). A routed row, whose layout cannot be rebuilt on the CPU, keeps the device
    prediction recorded with it; its eager prediction is that device prediction under the host rule
    (:mod:`.host`: the part's measured host time and ``do_bench``'s flush), and its ``predicted_with`` says
    so."""
    import json
    from .calibrate import BENCH_DIR, EVALUATION_FILES
    from .ceilings import Ceilings, load_record
    from .host import eager_ms, flush_ms
    rec = load_record("h200")
    t_flush = flush_ms(Ceilings.from_json(rec["ceilings"]))
    pred = {r["id"]: r["predicted_ms"] for r in rec["calibration"]["points"]}
    for fname in EVALUATION_FILES:
        path = pathlib.Path(args.bench) / fname if args.bench else BENCH_DIR / fname
        doc = json.loads(path.read_text())
        n = 0
        for i, r in enumerate(doc["results"]):
            key = f"{fname}#{i}"
            if key in pred:
                r["predicted_ms"] = pred[key]
                r["predicted_with"] = f"model of {rec['calibration']['date']}"
                n += 1
            if f"{key}:graph" in pred:  # the row's CUDA-graph replay, priced without a host term
                r["device_predicted_ms"] = pred[f"{key}:graph"]
            elif r.get("predicted_ms") is not None:
                host = doc.get("parts", {}).get(r.get("part"), {}).get("host_ms", {}).get(f"{r['impl']}/{r['pass']}")
                dev = r.get("device_predicted_ms")
                if r["pass"] in ("fwd", "bwd") and host is not None and dev is not None:
                    r["predicted_ms"] = eager_ms(dev, host, t_flush)
                    r["predicted_with"] = ("the device prediction recorded with the row under the host rule of the "
                                           f"model of {rec['calibration']['date']} (the layout is not rebuilt on "
                                           "the CPU)")
                else:
                    r["predicted_with"] = "recorded with the row (not re-priced: the layout is not rebuilt on the CPU)"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{path}: {n} predictions rewritten")
    return 0


def cmd_accuracy(args) -> int:
    from .calibrate import summary_table
    from .ceilings import load_record
    acc = load_record("h200")["calibration"]["accuracy"]
    print(summary_table(acc))
    from .calibrate import series_table
    prev = load_record("h200")["calibration"].get("previous") or {}
    print()
    print(series_table(acc.get("sweep_series", {}), prev.get("sweep_series")))
    print(f"\noutside +-25% ({len(acc['outside_25pct'])}):")
    for r in acc["outside_25pct"]:
        print(f"  {r['label']:60s} ratio {r['ratio']:.2f}")
    return 0


def cmd_report(args) -> int:
    from .calibrate import RECORDED_PATTERNS
    from .crossover import report
    if args.pattern not in RECORDED_PATTERNS:
        print(f"pattern must be one of {sorted(RECORDED_PATTERNS)}", file=sys.stderr)
        return 2
    print(report(RECORDED_PATTERNS[args.pattern](args.n), pass_=args.pass_, measure=args.measure))
    return 0


def cmd_crossover(args) -> int:
    from .crossover import crossover
    print(crossover(args.family, args.pass_))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparseattn.roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ceilings", help="measure this GPU's ceilings")
    p.add_argument("--out", default=".")
    p.set_defaults(fn=cmd_ceilings)
    p = sub.add_parser("check", help="ceilings, predicted vs measured, profiles (GPU)")
    p.add_argument("--out", default=".")
    p.add_argument("--n", default="8192", help="comma-separated prefill lengths")
    p.add_argument("--patterns", default="causal,window1024,sinks64+window1024,random10%%+diag")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("calibrate", help="refit on the recorded bench files")
    p.add_argument("--bench", default=None, help="directory of the bench JSON files (default book/data/bench)")
    p.add_argument("--out", default=None, help="record to write (default: the packaged one)")
    p.add_argument("--iters", type=int, default=600)
    p.set_defaults(fn=cmd_calibrate)
    p = sub.add_parser("repredict", help="rewrite the crossover sweep's predicted_ms from the packaged model")
    p.add_argument("--bench", default=None, help="directory of the bench JSON files (default book/data/bench)")
    p.set_defaults(fn=cmd_repredict)
    p = sub.add_parser("accuracy", help="accuracy of the packaged model")
    p.set_defaults(fn=cmd_accuracy)
    p = sub.add_parser("report", help="will sparse be faster here?")
    p.add_argument("pattern")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--pass", dest="pass_", default="fwd", choices=["fwd", "bwd"])
    p.add_argument("--measure", action="store_true")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("crossover", help="predicted crossover of a family")
    p.add_argument("family")
    p.add_argument("--pass", dest="pass_", default="fwd", choices=["fwd", "bwd"])
    p.set_defaults(fn=cmd_crossover)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
