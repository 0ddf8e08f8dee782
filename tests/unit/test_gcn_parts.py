"""Lesson 4's parts, in-process: seed chunks per rank, the synthetic graph, the refusals (with CUDA
or the sampler faked), the sampling workers by default, the graph mapped from one sorted file, the
metric sums, the pinned batches, the batch figure."""
import os
import shutil
import socket
import sys

import pytest
import torch
from graph_files import write_ogbn_products_raw
from helpers import OFFLINE, load_script, needs_sampler, refused_before_spawn

pytest.importorskip("torch_geometric", reason="torch_geometric is not installed (make setup installs it)")
gcn = load_script("gcn_ddp")
parts = sys.modules["gcn_parts"]  # the module gcn_ddp.py imports: its graphs, scoring, flags
CPU = ["--device", "cpu"]


def test_rank_chunks_are_disjoint_equal_and_cover_the_floor():
    train = torch.randperm(1003)[:1001]
    for world in (1, 2, 3, 4):
        chunks = [gcn.rank_chunk(train, epoch=1, rank=r, world_size=world, seed=7) for r in range(world)]
        assert {len(c) for c in chunks} == {1001 // world}
        joined = torch.cat(chunks)
        assert len(joined.unique()) == len(joined) == world * (1001 // world)
        assert set(joined.tolist()) <= set(train.tolist())
    # the same shuffle on every rank for a given epoch, a different one the next epoch
    again = gcn.rank_chunk(train, epoch=1, rank=0, world_size=2, seed=7)
    assert torch.equal(again, gcn.rank_chunk(train, epoch=1, rank=0, world_size=2, seed=7))
    assert not torch.equal(again, gcn.rank_chunk(train, epoch=2, rank=0, world_size=2, seed=7))
    assert torch.equal(gcn.rank_chunk(train, 1, 0, 2, 7, shuffle=False), train[:500])


def test_synthetic_graph_is_deterministic_and_has_skewed_degrees():
    a, split_a, _ = parts.synthetic_graph(3000, seed=1)
    b, split_b, _ = parts.synthetic_graph(3000, seed=1)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x)
    assert torch.equal(split_a["test"], split_b["test"])
    degree = torch.bincount(a.edge_index[1], minlength=3000).float()
    assert degree.max() > 8 * degree.median()  # hubs
    same = (a.y[a.edge_index[0]] == a.y[a.edge_index[1]]).float().mean()
    assert 0.5 < same < 0.8  # communities, not cliques


def refused(monkeypatch, argv, gpus=0, sampler=True):
    import torch_geometric.typing as pyg_typing

    monkeypatch.setattr(pyg_typing, "WITH_PYG_LIB", sampler and pyg_typing.WITH_PYG_LIB)
    monkeypatch.setattr(pyg_typing, "WITH_TORCH_SPARSE", sampler and pyg_typing.WITH_TORCH_SPARSE)
    return refused_before_spawn(gcn, monkeypatch, argv, gpus)


def test_missing_sampler_library_is_refused_with_the_command(monkeypatch):
    message = refused(monkeypatch, CPU, sampler=False)
    assert "pyg-lib or torch-sparse" in message and "pip install" in message


def test_more_gpu_ranks_than_gpus_is_refused(monkeypatch):
    needs_sampler()
    assert "3 processes but 2 visible GPU(s)" in refused(monkeypatch, ["--nprocs", "3"], gpus=2)


def test_fan_outs_must_match_the_layers(monkeypatch):
    needs_sampler()
    assert "2 fan-outs" in refused(monkeypatch, [*CPU, "--num-neighbors", "15,10,5"])


@pytest.mark.parametrize("args", [["--dataset", "cora"], ["--num-neighbors", "ten"], ["--nprocs", "0"],
                                  ["--device", "cpu", "--num-workers", "-1"]])
def test_bad_flags(monkeypatch, args):
    refused(monkeypatch, args)


@pytest.mark.parametrize("device, cores, nprocs, workers", [("cpu", 16, 2, 0), ("cuda", 16, 2, 4),
                                                            ("cuda", 4, 2, 1), ("cuda", 2, 2, 0)])
def test_sampling_workers_by_default(monkeypatch, device, cores, nprocs, workers):
    """0 on CPU (the cores run the ranks); on GPUs a rank's share of the cores less one, at most 4."""
    monkeypatch.setattr(gcn.hardening.os, "sched_getaffinity", lambda pid: range(cores), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = gcn.parse_args(["--device", device, "--nprocs", str(nprocs)])
    assert args.num_workers == workers
    assert gcn.parse_args(["--device", device, "--num-workers", "3"]).num_workers == 3


@pytest.mark.parametrize("rate", ["1", "-0.1", "half"])
def test_dropout_must_be_a_probability(rate, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(gcn.hardening, "leave", sys.exit)  # run_main ends through leave(): os._exit
    with pytest.raises(SystemExit) as exit_info:
        gcn.hardening.run_main(gcn.main, gcn.parse_args, ["--dropout", rate])
    message = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--dropout" in message and message.count("\n") == 1


def mapped_from(tensor, path):
    """Whether the tensor's memory is a mapping of the file at path (Linux: /proc/self/maps)."""
    address = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        span, *_, name = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in span.split("-"))
        if name.strip() == str(path) and start <= address < end:
            return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_under_torchrun_a_real_graph_is_mapped_from_one_sorted_file(tmp_path, monkeypatch):
    """Each torchrun rank loads the graph itself: the first saves it, sorted, beside the dataset's
    processed file, and every rank maps that file (pages shared, not a copy per rank)."""
    pytest.importorskip("ogb", reason="ogb is not installed (make setup installs it)")
    write_ogbn_products_raw(tmp_path)
    args = gcn.parse_args(["--dataset", "ogbn-products", "--data-dir", str(tmp_path)])
    reference, reference_split, _ = parts.ogbn_products(str(tmp_path))
    gcn.prepare_graph(reference, reference_split)  # what mp.spawn's ranks get
    saved = tmp_path / "ogbn_products" / "processed" / "sorted_for_ddp.pt"
    data, split, metric = gcn.load_mapped(args)
    assert saved.exists() and metric == "accuracy" and len(split["train"]) == 360
    for key in ("x", "edge_index", "y"):
        assert torch.equal(data[key], reference[key]), key
        assert mapped_from(data[key], saved), key
    written = saved.stat().st_mtime_ns
    again = gcn.load_mapped(args)[0]  # the next rank maps the same file
    assert saved.stat().st_mtime_ns == written and mapped_from(again.x, saved)
    # Processed again (a new download): the sorted copy is made again.
    processed = tmp_path / "ogbn_products" / "processed" / "geometric_data_processed.pt"
    os.utime(processed, ns=(written + 10**9, written + 10**9))
    gcn.load_mapped(args)
    assert saved.stat().st_mtime_ns > written


def test_when_the_sorted_copy_cannot_be_saved_each_rank_keeps_its_own(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ogb", reason="ogb is not installed (make setup installs it)")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    write_ogbn_products_raw(tmp_path)
    args = gcn.parse_args(["--dataset", "ogbn-products", "--data-dir", str(tmp_path)])
    parts.ogbn_products(str(tmp_path))
    saved = tmp_path / "ogbn_products" / "processed" / "sorted_for_ddp.pt"
    (saved.parent / f"{saved.name}.{socket.gethostname()}.{os.getpid()}.part").mkdir()  # blocks the write
    data, split, _ = gcn.load_mapped(args)
    assert not saved.exists() and "each rank holds its own copy" in capsys.readouterr().out
    assert data.num_nodes == 600 and len(split["train"]) == 360
    assert bool((data.edge_index[1][1:] >= data.edge_index[1][:-1]).all())  # sorted all the same


def test_ogbn_products_without_ogb_says_what_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "ogb.nodeproppred.dataset_pyg", None)  # import fails
    with pytest.raises(gcn.UsageError, match="pip install ogb"):
        parts.ogbn_products(str(tmp_path))


def test_fp16_on_cpu_is_refused(monkeypatch):
    needs_sampler()
    assert "--amp fp16 is for GPUs" in refused(monkeypatch, [*CPU, "--amp", "fp16"])


def test_eval_subset_is_fixed_and_capped():
    idx = torch.arange(100, 200)
    assert parts.eval_subset(idx, None, 0) is idx and parts.eval_subset(idx, 500, 0) is idx
    a, b = parts.eval_subset(idx, 30, 0), parts.eval_subset(idx, 30, 0)
    assert torch.equal(a, b) and len(a.unique()) == 30 and set(a.tolist()) <= set(idx.tolist())


def test_batch_figure_assigns_hops_along_sampled_edges(tmp_path):
    needs_sampler()
    import sys

    from helpers import REPO

    sys.path.insert(0, str(REPO / "notebooks"))
    import course_demos

    batch = course_demos.sample_batch(num_nodes=3000, seeds=3, num_neighbors=(4, 3))
    hop, parent = course_demos.hops(batch)
    assert (hop[:3] == 0).all() and (hop >= 0).all()  # seeds first; every node reached
    for h, fan_out, below in ((1, 4, 3), (2, 3, int((hop == 1).sum()))):
        nodes = (hop == h).nonzero().view(-1)
        assert 0 < len(nodes) <= fan_out * below
        assert (hop[parent[nodes]] == h - 1).all()  # sampled for a node one hop nearer the seeds
    counts = course_demos.draw(batch, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 10_000 and sum(counts.values()) == batch.num_nodes


@pytest.mark.parametrize("multi_label", [False, True], ids=["accuracy", "micro-F1"])
def test_metrics_summed_over_unequal_shards_equal_the_metric_on_the_whole(multi_label):
    """Evaluation adds up counts (correct and total; true positives, false positives, false
    negatives) over batches and ranks, and computes the metric once: that equals the metric of one
    process on all the nodes. Averaging the ranks' metrics would not, with shards of unequal size."""
    g = torch.Generator().manual_seed(0)
    out = torch.randn(103, 5, generator=g)
    y = ((torch.rand(103, 5, generator=g) > 0.6).float() if multi_label
         else torch.randint(0, 5, (103,), generator=g))
    shards = [slice(0, 17), slice(17, 103)]  # two ranks, 17 and 86 nodes

    def reference(out, y):  # the metric computed directly, on one set of nodes
        if multi_label:
            pred, truth = out > 0, y > 0.5
            tp, fp, fn = (pred & truth).sum(), (pred & ~truth).sum(), (~pred & truth).sum()
            return (2 * tp / (2 * tp + fp + fn).double()).item()
        return (out.argmax(1) == y).double().mean().item()

    summed = sum(parts.metric_sums(out[s], y[s]) for s in shards)
    whole = reference(out, y)
    assert parts.metric_value(summed, multi_label) == pytest.approx(whole, abs=1e-12)
    averaged = sum(reference(out[s], y[s]) for s in shards) / len(shards)
    assert abs(averaged - whole) > 1e-3  # what averaging the ranks' metrics would give instead


@pytest.mark.parametrize("device, pinned", [("cuda", True), ("cpu", False)])
def test_batches_for_a_gpu_come_in_pinned_memory(monkeypatch, device, pinned):
    """Each sampled batch is copied to the GPU with non_blocking=True, which overlaps with the GPU's
    work only from pinned (page-locked) memory: the loaders pin on CUDA (lesson 3), not on CPU."""
    import torch_geometric.loader

    made = []
    monkeypatch.setattr(torch_geometric.loader, "NeighborLoader", lambda data, **kwargs: made.append(kwargs))
    args = gcn.parse_args(["--device", device, "--num-workers", "0"])
    for script in (gcn, load_script("gcn_single")):
        script.neighbor_loader(None, torch.arange(10), None, args)
    assert [kwargs["pin_memory"] for kwargs in made] == [pinned, pinned]
    assert all(kwargs["input_nodes"].tolist() == list(range(10)) for kwargs in made)


def test_a_graph_larger_than_the_free_shared_memory_is_refused(monkeypatch):
    needs_sampler()
    """Under mp.spawn the graph goes to /dev/shm; with too little there (a container's 64 MB), one
    line says so, before any rank starts, instead of every rank dying of a bus error."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    free = {"bytes": 10 * 2**20}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: type("usage", (), {"free": free["bytes"]}))
    message = refused(monkeypatch, [*CPU, "--nprocs", "2", "--num-nodes", "20000", "--max-steps", "1"])
    assert "MiB of shared memory and /dev/shm has 10 MiB free" in message and "--shm-size" in message


def test_amazon_products_offline_without_files_is_refused(monkeypatch, tmp_path):
    needs_sampler()
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    line = refused(monkeypatch, [*CPU, "--dataset", "amazon-products", "--data-dir", str(tmp_path)])
    assert "AmazonProducts is not in" in line


def test_ogbn_products_offline_without_files_is_refused_and_leaves_nothing(monkeypatch, tmp_path):
    needs_sampler()
    pytest.importorskip("ogb", reason="ogb is not installed (make setup installs it)")
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    line = refused(monkeypatch, [*CPU, "--dataset", "ogbn-products", "--data-dir", str(tmp_path)])
    assert "ogbn-products is not in" in line
    assert not (tmp_path / "ogbn_products").exists()  # or ogb would take it for an old release
