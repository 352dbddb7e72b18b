import sys, time, cProfile, pstats, io
sys.path[:0] = ["benchmarks", "."]
import bench_worker_gpu as b
import torch
from kvtail_connector.metadata import KVTailMetadata
from kvtail_connector.ops.zero.plan import line_work
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

def t(fn, reps=2000, before=None):
    out = []
    for _ in range(reps):
        if before: before()
        torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    out.sort(); return out[len(out)//2]*1e6

x = torch.empty(1, device="cuda")
b._noop[(1,)](x)
print("bare jit launch", t(lambda: b._noop[(1,)](x)))
w = b.build_worker(80, 1024)
rank = w._rank; z = rank.zeroer; L = z._launcher
for n in (1, 64):
    recs = b.records(n, 1024)
    fin = {r.req_id for r in recs}
    meta = KVTailMetadata(inner=None, loads=recs)
    bind = lambda: w.bind(meta)
    print(n, "on_transfer_results", t(lambda: w.on_transfer_results(fin, (), b._NoLoadErrors()), before=bind))
    print(n, "transfer_results", t(lambda: w.transfer_results(KVConnectorTransferResults(finished_recving=fin), set(), b._NoLoadErrors()), before=bind))
    w.bind(meta)
    lines = [ln for p in w._tails._loads.values() for ln in p.tails.lines]
    w.on_transfer_results(fin, (), b._NoLoadErrors())
    print(n, "zero_lines", t(lambda: z.zero_lines(lines)))
    work, units = line_work(lines)
    print(n, "line_work", t(lambda: line_work(lines)))
    if L._graphs is not None and work.size <= L._graphs.entries:
        print(n, "graphs.run", t(lambda: L._graphs.run(work)))
        slot = L._graphs._slots[0]
        print(n, "replay only", t(lambda: slot.graph.replay()))
    print(n, "rank.zero(batches)", "n/a")
    # cProfile of the full completion
    pr = cProfile.Profile()
    for _ in range(300):
        w.bind(meta); torch.cuda.synchronize()
        pr.enable(); w.transfer_results(KVConnectorTransferResults(finished_recving=fin), set(), b._NoLoadErrors()); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:4000])
ev = torch.cuda.Event()
print("event.record", t(lambda: ev.record()))
print("event.query", t(lambda: ev.query()))
print("bind 1 load", t(lambda: w.bind(KVTailMetadata(inner=None, loads=b.records(1,1024))), before=lambda: w._tails._loads.clear()))
