"""How bench_train.py and bench_train_dist.py report their rows: the closing table beside the all-GPU
rows, the CPU update's note from two stats(), --repeat's medians, the spread between groupings and
--check-exact's comparison."""
import statistics

import torch


def median_line(name, its, ratios, against):
    """--repeat's summary line of one row: its median iteration (s, over the rounds) with the range,
    then the median of its ratios `against` a base row with their range (none where `ratios` is empty)."""
    its, ratios = sorted(its), sorted(ratios)
    line = "   %s %8.1f ms (%.1f-%.1f)" % (name, statistics.median(its) * 1e3, its[0] * 1e3, its[-1] * 1e3)
    if ratios:
        line += "  %5.2fx %s (%.2f-%.2f)" % (statistics.median(ratios), against, ratios[0], ratios[-1])
    return line


def cpu_update(before, after, steps):
    """What the offloaded update's CPU Adam did per timed step, from two stats() (None when this
    ferry.torch has no such stats, or nothing ran on the CPU): its busy ms per step, the bytes it moved
    per second of it (GB/s, to set beside the host's STREAM or `ferry bench adam`), the share of the
    pinned memory huge pages back (None when this ferry.torch does not say), the share of its bytes
    that went out of place into the spare state (None: not said), and the early groups kept,
    recomputed and the steps skipped (non-finite grads) over those steps."""
    if "cpu_adam_busy_seconds" not in after:
        return None
    busy = after["cpu_adam_busy_seconds"] - before["cpu_adam_busy_seconds"]
    if busy <= 0:
        return None
    moved = after["cpu_adam_bytes"] - before["cpu_adam_bytes"]
    pinned = after.get("pinned_bytes", 0)
    return {"ms": busy * 1e3 / steps, "gbs": moved / busy / 1e9,
            "huge": after["pinned_huge_bytes"] / pinned if pinned and "pinned_huge_bytes" in after else None,
            "spare": ((after["cpu_adam_spare_bytes"] - before["cpu_adam_spare_bytes"]) / moved
                      if moved and "cpu_adam_spare_bytes" in after else None),
            "later": ((after["cpu_adam_later_bytes"] - before["cpu_adam_later_bytes"]) / moved
                      if moved and "cpu_adam_later_bytes" in after else None),
            "later_limit": after.get("state_later_limit_bytes"), "later_kept": after.get("state_later_kept_bytes"),
            "kept": after["early_groups_kept"] - before["early_groups_kept"],
            "recomputed": after["early_groups_recomputed"] - before["early_groups_recomputed"],
            "skipped": after["skipped_steps"] - before["skipped_steps"], "workers": after.get("cpu_threads")}


def cpu_text(cpu, whose="", iteration=None):
    """cpu_update's dict as a bracketed note for a row's line ('' for None); `whose` ends it (e.g.
    "rank 0"). With the row's `iteration` (s), also the iteration less CPU Adam's time: where the
    loop is bound by the CPU update, the time the overlap left CPU Adam nothing to do."""
    if cpu is None:
        return ""
    text = "   [CPU Adam %.1f ms/step at %.1f GB/s" % (cpu["ms"], cpu["gbs"])
    if cpu.get("workers"):
        text += " on %d worker%s" % (cpu["workers"], "" if cpu["workers"] == 1 else "s")
    if iteration is not None:
        text += " (the iteration less it: %.1f ms)" % (iteration * 1e3 - cpu["ms"])
    if cpu["huge"] is not None:
        text += ", pinned memory %.0f%% huge pages" % (100 * cpu["huge"])
    if cpu.get("spare"):
        text += ", %.0f%% of its bytes out of place" % (100 * cpu["spare"])
    if cpu.get("later"):
        text += ", %.0f%% in the state's rounds after the params (state_later" % (100 * cpu["later"])
        if cpu.get("later_kept"):
            text += ": up to %.0f MB of grads a step, of a %.0f MB buffer" % (cpu["later_limit"] / 1e6,
                                                                             cpu["later_kept"] / 1e6)
        text += ")"
    if cpu["kept"] or cpu["recomputed"]:
        text += "; early groups kept %d, recomputed %d" % (cpu["kept"], cpu["recomputed"])
    if cpu["skipped"]:
        text += "; %d steps skipped" % cpu["skipped"]
    return text + (", " + whose if whose else "") + "]"


def print_table(results, loop):
    """Every row with its loop, beside the all-GPU iterations of the same run and loop: Ferry's
    all_gpu row (the ratio the README's figures give) and torch's AdamW row."""
    base = {name: it for row, it, _, _ in results if it is not None
            for name in [row["name"]] if name in ("ferry all_gpu", "torch AdamW (fused)")}
    ferry_base, torch_base = base.get("ferry all_gpu"), base.get("torch AdamW (fused)")

    def against(it, ref):
        return "%9s  %6s" % ("-", "-") if ref is None else "%6.1f ms  %5.2fx" % (ref * 1e3, it / ref)

    print("   %-30s %-31s %11s   %-17s  %s" % ("row", "loop (groups, clip, amp)", "iteration",
                                              "ferry all_gpu, ratio", "torch AdamW, ratio"), flush=True)
    for row, iteration, _, why in results:
        if iteration is None:
            print("   %-30s %-31s skipped: %s" % (row["name"], loop.label(), why), flush=True)
            continue
        print("   %-30s %-31s %8.1f ms  %s    %s" % (row["name"], loop.label(), iteration * 1e3,
              against(iteration, ferry_base), against(iteration, torch_base)), flush=True)


def print_medians(per_round, loop):
    """--repeat: each row's median iteration over the rounds and its range, and the median of its
    ratios to each round's ferry all_gpu row."""
    print("   over %d rounds, alternated: the median (the range)" % len(per_round), flush=True)
    for i, (row, _, _, _) in enumerate(per_round[0]):
        its = [r[i][1] for r in per_round if r[i][1] is not None]
        if not its:
            continue
        ratios = []
        for results in per_round:
            base = next((it for rw, it, _, _ in results if rw["name"] == "ferry all_gpu" and it is not None), None)
            if base and results[i][1] is not None:
                ratios.append(results[i][1] / base)
        print(median_line("%-30s %-31s" % (row["name"], loop.label()), its, ratios, "ferry all_gpu"), flush=True)


def check_losses(results):
    """--check-exact: whether every exact row's losses are the bits of ferry all_gpu's (printed); false
    when no row was compared with it (a check that compared nothing passes nothing)."""
    ok, compared = True, 0
    ref = next((r for r in results if r[0]["name"] == "ferry all_gpu" and r[1] is not None), None)
    for row, _, losses, _ in results:
        if row.get("exact") and ref is not None and losses is not None:
            same = torch.equal(losses, ref[2])
            ok = ok and same
            compared += 1
            print("   losses of %-30s %s ferry all_gpu's (%s)" % (row["name"], "==" if same else "!=",
                  ", ".join("%.6f" % v for v in losses[:4].tolist())), flush=True)
    if compared < 2:
        print("   --check-exact: fewer than two fp32 ferry rows ran (ferry all_gpu and another): nothing compared",
              flush=True)
        return False
    return ok


def print_spread(per_round, loops):
    """Several groupings (--groups a,b,...): each row's median iteration per grouping over the rounds,
    how far apart the groupings lie (the largest median over the smallest, less 1), and for an
    offloaded row whose step alone ran, the median of its ratio to the larger of the round's ferry
    all_gpu and that step alone; for an overlapped row, the groupings' idle CPU too (idle_line)."""
    first = per_round[loops[0].groups][0]
    print("   the groupings, alternated over %d round%s: each row's median; spread = the largest / the smallest - 1"
          % (len(per_round[loops[0].groups]), "" if len(per_round[loops[0].groups]) == 1 else "s"), flush=True)
    for i, (row, _, _, _) in enumerate(first):
        cells, medians = [], []
        for each in loops:
            rounds = per_round[each.groups]
            its = [r[i][1] for r in rounds if r[i][1] is not None]
            if not its:
                continue
            medians.append(statistics.median(its))
            cell = "%s %.1f ms" % (each.groups, medians[-1] * 1e3)
            ratios = []
            for results in rounds:
                base = next((it for rw, it, _, _ in results if rw["name"] == "ferry all_gpu" and it is not None), None)
                alone = results[i][0].get("alone")
                if base and alone and results[i][1] is not None:
                    ratios.append(results[i][1] / max(base, alone))
            if ratios:
                cell += " (%.2fx the larger of all-GPU and the step alone)" % statistics.median(ratios)
            cells.append(cell)
        if len(medians) == len(loops):
            print("   %-30s %s   spread %.1f%%" % (row["name"], ", ".join(cells),
                                                   100 * (max(medians) / min(medians) - 1)), flush=True)
            idle = idle_line(per_round, loops, i, statistics.median(medians))
            if idle:
                print(idle, flush=True)


def idle_line(per_round, loops, i, iteration):
    """For an overlapped row whose CPU update was measured in every grouping: each grouping's median
    of the iteration less CPU Adam's time (what the overlap left CPU Adam nothing to do), and how far
    apart those lie in ms and as a share of the row's median `iteration` (s). Where the loop is bound
    by the CPU update, its iteration follows the host's memory bandwidth, which drifts from minute to
    minute; this part does not, and is what the grouping changes. None where it does not apply."""
    cells, idles = [], []
    for each in loops:
        vals = [r[i][1] * 1e3 - r[i][0]["cpu"]["ms"] for r in per_round[each.groups]
                if r[i][1] is not None and r[i][0].get("overlap") and r[i][0].get("cpu")]
        if not vals:
            return None
        idles.append(statistics.median(vals))
        cells.append("%s %.1f ms" % (each.groups, idles[-1]))
    apart = max(idles) - min(idles)
    return "   %-30s the iteration less CPU Adam: %s; %.1f ms apart (%.1f%% of the iteration)" % (
        "", ", ".join(cells), apart, 100 * apart / (iteration * 1e3))
