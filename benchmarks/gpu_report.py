"""Summarise a real GPU tuning (benchmarks/gpu_check.sh): per experiment its status, metric, the memory model's estimate
against the peak the tuner read, and the last probe record's allocated, reserved and device peaks (GiB).

Run: python3 benchmarks/gpu_report.py EXPS_DIR
"""
import glob
import json
import os
import sys

exps = sys.argv[1]
for d in sorted(glob.glob(os.path.join(exps, "*")), key=os.path.getmtime):
    p = os.path.join(d, "exp.json")
    if not os.path.exists(p):
        continue
    e = json.load(open(p))
    recs = []
    for f in sorted(glob.glob(os.path.join(d, "probe.rank*.jsonl"))):
        recs += [json.loads(l) for l in open(f) if l.strip()]
    last = recs[-1] if recs else {}
    g = lambda k: (None if last.get(k) is None else round(last[k] / 2**30, 2))
    print(f"{e['name']:40s} {e['status']:8s} metric={e['metric']} hw={e.get('metric_rel_half_width')} ended={e.get('ended')} "
          f"wall={e.get('wall_s')} est={None if not e.get('memory_bytes') else round(e['memory_bytes']/2**30,2)} "
          f"peak={None if not e.get('peak_memory_bytes') else round(e['peak_memory_bytes']/2**30,2)} "
          f"rec: alloc={g('peak_bytes')} reserved={g('peak_reserved_bytes')} device={g('device_peak_bytes')} steps={len(recs)} "
          f"err={(e.get('error') or '')[:150]!r}")
act = glob.glob(os.path.join(exps, "profile*", "activations.json"))
if act:
    print("profile activations.json:", open(act[0]).read()[:500])
