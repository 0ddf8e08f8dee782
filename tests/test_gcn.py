"""Lesson 4: the GCN under DDP (synthetic graph, ogbn-products and AmazonProducts from tiny raw
files in their own layouts), per-rank seed chunks, mixed precision, refusals, the batch figure."""
import os
import socket
import sys

import pytest
import torch
from conftest import (
    GPUS,
    OFFLINE,
    load_script,
    needs_gpu,
    read_metrics,
    refused_before_spawn,
    run_script,
    script_env,
    torchrun,
)

pytest.importorskip("torch_geometric", reason="torch_geometric is not installed (make setup installs it)")
gcn = load_script("gcn_ddp")
CPU = ["--device", "cpu"]
SMALL = ["--num-nodes", 6000, "--batch-size", 256, "--hidden", 64]
BF16 = GPUS > 0 and torch.cuda.get_device_capability(0) >= (8, 0)


def test_two_ranks_learn_on_the_synthetic_graph(tmp_path):
    out = tmp_path / "m.json"
    r = run_script("gcn_ddp.py", *CPU, "--nprocs", 2, *SMALL, "--epochs", 3, "--metrics-json", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("done:") == 1
    metrics = read_metrics(out)
    assert (metrics["world_size"], metrics["metric"], metrics["dataset"]) == (2, "accuracy", "synthetic")
    epochs = metrics["epochs"]
    losses = [e["train_loss"] for e in epochs]
    assert losses[0] > losses[1] > losses[2], losses
    assert epochs[-1]["test_metric"] > 3 / 16  # 16 classes: chance is 1/16
    assert all(e["sampled_nodes_per_second"] > 0 and e["seconds"] > 0 for e in epochs)
    # every rank got 6000 * 0.6 // 2 = 1800 seed nodes per epoch
    assert epochs[0]["seed_nodes"] == 2 * (3600 // 2)


def test_one_rank_trains_exactly_as_the_single_process_script(tmp_path):
    """gcn_single.py is lesson 4's baseline: one DDP rank takes exactly its steps, dropout and
    sampling included (the same seeds, the same random streams)."""
    flags = [*CPU, *SMALL, "--max-steps", 6, "--eval-nodes", 500, "--quiet"]
    weights, metrics = [], []
    for script, extra in (("gcn_single.py", []), ("gcn_ddp.py", ["--nprocs", 1])):
        out = tmp_path / f"{script}.pt"
        r = run_script(script, *flags, *extra, "--save", out, "--metrics-json", tmp_path / f"{script}.json")
        assert r.returncode == 0, r.stderr
        weights.append(torch.load(out))
        metrics.append(read_metrics(tmp_path / f"{script}.json")["epochs"][-1])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert metrics[0]["train_loss"] == metrics[1]["train_loss"] and metrics[0]["steps"] == 6
    assert metrics[0]["test_metric"] > 1 / 16  # it learns: 16 classes, chance is 1/16


def test_three_ranks_with_a_node_count_that_does_not_divide(tmp_path):
    out = tmp_path / "m.json"
    # 5003 nodes: 3001 training seeds, not a multiple of 3, nor of the batch size
    r = run_script("gcn_ddp.py", *CPU, "--nprocs", 3, "--num-nodes", 5003, "--batch-size", 100,
                   "--hidden", 32, "--timeout", 60, "--metrics-json", out, timeout=180)
    assert r.returncode == 0, r.stderr
    (epoch,) = read_metrics(out)["epochs"]
    assert epoch["seed_nodes"] == 3 * (3001 // 3)
    assert epoch["steps"] == -(-(3001 // 3) // 100)  # ceil: the same on every rank


def test_two_ranks_under_torchrun(tmp_path):
    # No launcher of ours: each rank loads the graph itself, rank 0 first (a barrier between).
    out = tmp_path / "m.json"
    r = run_script("gcn_ddp.py", *CPU, "--num-nodes", 3000, "--batch-size", 128, "--hidden", 32,
                   "--max-steps", 5, "--metrics-json", out,
                   launcher=torchrun(2))
    assert r.returncode == 0, r.stderr
    metrics = read_metrics(out)
    assert metrics["world_size"] == 2 and metrics["epochs"][0]["steps"] == 5


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_takes_the_steps_of_one_process_averaging_the_ranks_batches(tmp_path, world_size):
    """The lesson-2 check for a GNN: nothing random (dropout 0, every neighbour), N ranks end with
    the weights of one process that, at each step, averages the losses of the N ranks' batches."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "notebooks"))
    from course_helpers import gcn_steps_in_one_process

    flags = [*CPU, "--dataset", "synthetic", "--num-nodes", 2000, "--hidden", 32, "--dropout", 0,
             "--num-neighbors=-1,-1", "--batch-size", 40, "--max-steps", 8, "--nprocs", world_size]
    r = run_script("gcn_ddp.py", *flags, "--quiet", "--save", tmp_path / "ddp.pt")
    assert r.returncode == 0, r.stderr
    ddp = torch.load(tmp_path / "ddp.pt")
    args = gcn.parse_args([str(f) for f in flags])
    data, split, _ = gcn.load_dataset(args)
    gcn.prepare_graph(data, split)

    def max_diff(weights):
        assert weights.keys() == ddp.keys()
        return max((weights[k] - ddp[k]).abs().max().item() for k in ddp)

    assert max_diff(gcn_steps_in_one_process(gcn, data, split, args, world_size)) < 1e-5
    # The comparison can fail: the same seeds sampled as ONE subgraph per step train differently
    # (nodes at the rim of one rank's subgraph are inner nodes of the joint one: other degrees) ...
    assert max_diff(gcn_steps_in_one_process(gcn, data, split, args, world_size, one_subgraph=True)) > 1e-2
    # ... and training moved the weights far from where they started.
    torch.manual_seed(args.seed)
    assert max_diff(gcn.GCN(data.num_features, 32, int(data.y.max()) + 1).state_dict()) > 1e-2


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
    a, split_a, _ = gcn.synthetic_graph(3000, seed=1)
    b, split_b, _ = gcn.synthetic_graph(3000, seed=1)
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
    assert "3 processes but 2 visible GPU(s)" in refused(monkeypatch, ["--nprocs", "3"], gpus=2)


def test_fan_outs_must_match_the_layers(monkeypatch):
    assert "2 fan-outs" in refused(monkeypatch, [*CPU, "--num-neighbors", "15,10,5"])


@pytest.mark.parametrize("args", [["--dataset", "cora"], ["--num-neighbors", "ten"], ["--nprocs", "0"],
                                  ["--device", "cpu", "--num-workers", "-1"]])
def test_bad_flags(args):
    r = run_script("gcn_ddp.py", *args, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_fewer_training_nodes_than_ranks_is_refused(launcher):
    """3 nodes leave 1 training node for 3 ranks: each would get 0 seeds and train on nothing."""
    flags = [*CPU, "--dataset", "synthetic", "--num-nodes", 3, "--max-steps", 2]
    if launcher == "spawn":
        r = run_script("gcn_ddp.py", *flags, "--nprocs", 3, timeout=60)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    else:  # torchrun adds its own report of the failed ranks
        r = run_script("gcn_ddp.py", *flags, launcher=torchrun(3), timeout=120)
        assert r.stderr.count("gcn_ddp.py: error:") == 1, r.stderr
    assert r.returncode != 0
    assert "1 training node(s) cannot be split across 3 processes" in r.stderr


@pytest.mark.parametrize("device, cores, nprocs, workers", [("cpu", 16, 2, 0), ("cuda", 16, 2, 4),
                                                            ("cuda", 4, 2, 1), ("cuda", 2, 2, 0)])
def test_sampling_workers_by_default(monkeypatch, device, cores, nprocs, workers):
    """0 on CPU (the cores run the ranks); on GPUs a rank's share of the cores less one, at most 4."""
    monkeypatch.setattr(gcn, "cpu_cores", lambda: cores)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = gcn.parse_args(["--device", device, "--nprocs", str(nprocs)])
    assert args.num_workers == workers
    assert gcn.parse_args(["--device", device, "--num-workers", "3"]).num_workers == 3


@pytest.mark.parametrize("rate", ["1", "-0.1", "half"])
def test_dropout_must_be_a_probability(rate, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        gcn.run_main(["--dropout", rate])
    message = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--dropout" in message and message.count("\n") == 1


def community_graph(rng, n, classes, edges_per_node):
    """A community per node, and edges that stay inside the source's community 80% of the time."""
    import numpy as np

    community = rng.integers(0, classes, n)
    src = rng.integers(0, n, edges_per_node * n)
    same = np.array([rng.choice(np.flatnonzero(community == community[s])) for s in src])
    dst = np.where(rng.random(len(src)) < 0.8, same, rng.integers(0, n, len(src)))
    return community, src, dst


def write_amazon_products_raw(root, n=800, classes=8, features=200, seed=0):
    """Tiny raw files in AmazonProducts' own layout (what its download leaves in raw/): a CSR
    adjacency in adj_full.npz, feats.npy, class_map.json (multi-hot rows), role.json (splits).
    Learnable: each node belongs to a community c, carries labels {c, c+1 mod classes}, has
    features near c's centroid, and links mostly inside c."""
    import json

    import numpy as np
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    community, src, dst = community_graph(rng, n, classes, edges_per_node=8)
    adj = sp.coo_matrix((np.ones(2 * len(src)), (np.r_[src, dst], np.r_[dst, src])), shape=(n, n)).tocsr()
    adj.data[:] = 1
    raw = root / "AmazonProducts" / "raw"
    raw.mkdir(parents=True)
    np.savez(raw / "adj_full.npz", data=adj.data, indices=adj.indices, indptr=adj.indptr, shape=adj.shape)
    centroids = rng.normal(size=(classes, features))
    feats = 0.3 * centroids[community] + rng.normal(size=(n, features))
    np.save(raw / "feats.npy", feats.astype("float32"))
    labels = np.zeros((n, classes), dtype=int)
    labels[np.arange(n), community] = 1
    labels[np.arange(n), (community + 1) % classes] = 1
    (raw / "class_map.json").write_text(json.dumps({str(i): labels[i].tolist() for i in range(n)}))
    order = rng.permutation(n).tolist()
    (raw / "role.json").write_text(json.dumps({"tr": order[:480], "va": order[480:640], "te": order[640:]}))


def train_offline_with_auto(data_dir, batch_size, expected):
    """2 ranks, 4 epochs, offline, --dataset auto: it must find the real graph in data_dir and
    learn; returns the last epoch's metrics."""
    out = data_dir / "m.json"
    r = run_script("gcn_ddp.py", *CPU, "--nprocs", 2, "--data-dir", data_dir, "--batch-size", batch_size,
                   "--hidden", 32, "--epochs", 4, "--lr", 0.01, "--metrics-json", out,
                   env=script_env(**OFFLINE))
    assert r.returncode == 0, r.stderr
    metrics = read_metrics(out)
    assert (metrics["dataset"], metrics["metric"]) == expected
    epochs = metrics["epochs"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    return epochs[-1]


def test_amazon_products_loader_processes_raw_files_and_trains_multilabel(tmp_path):
    write_amazon_products_raw(tmp_path)
    data, split, metric = gcn.amazon_products(str(tmp_path))  # PyG's own processing step runs
    assert (tmp_path / "AmazonProducts" / "processed" / "data.pt").exists()
    assert metric == "micro_f1" and data.y.shape == (800, 8) and data.x.shape == (800, 200)
    assert [len(split[k]) for k in ("train", "val", "test")] == [480, 160, 160]
    final = train_offline_with_auto(tmp_path, 64, ("amazon-products", "micro_f1"))
    # 2 of 8 labels per node: predicting none scores 0, predicting all 0.4
    assert final["test_metric"] > 0.5


def test_amazon_products_offline_without_files_is_refused(tmp_path):
    r = run_script("gcn_ddp.py", *CPU, "--dataset", "amazon-products", "--data-dir", tmp_path,
                   env=script_env(**OFFLINE), timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "AmazonProducts is not in" in r.stderr.strip().splitlines()[-1]


def write_ogbn_products_raw(root, n=600, classes=5, features=100, seed=0):
    """Tiny files in the layout of OGB's products.zip once ogb has unpacked it (data/ogbn_products:
    raw/*.csv.gz, split/sales_ranking/*.csv.gz, RELEASE_v1.txt), learnable as above, with one
    label per node."""
    import gzip

    import numpy as np

    rng = np.random.default_rng(seed)
    community, src, dst = community_graph(rng, n, classes, edges_per_node=6)
    feats = 0.4 * rng.normal(size=(classes, features))[community] + rng.normal(size=(n, features))
    order = rng.permutation(n)
    base = root / "ogbn_products"

    def write(name, rows):
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(base / name, "wt") as f:
            f.writelines(",".join(str(v) for v in row) + "\n" for row in rows)

    write("raw/edge.csv.gz", zip(src, dst))  # ogb adds the reverse edges itself
    write("raw/node-feat.csv.gz", np.round(feats, 4))
    write("raw/node-label.csv.gz", community[:, None])
    write("raw/num-node-list.csv.gz", [[n]])
    write("raw/num-edge-list.csv.gz", [[len(src)]])
    for name, part in (("train", order[:360]), ("valid", order[360:480]), ("test", order[480:])):
        write(f"split/sales_ranking/{name}.csv.gz", part[:, None])
    (base / "RELEASE_v1.txt").write_text("tiny test copy\n")


def test_ogbn_products_loader_processes_raw_files_and_trains(tmp_path):
    pytest.importorskip("ogb", reason="ogb is not installed (make setup installs it)")
    write_ogbn_products_raw(tmp_path)
    data, split, metric = gcn.ogbn_products(str(tmp_path))  # ogb's own processing step runs
    assert (tmp_path / "ogbn_products" / "processed" / "geometric_data_processed.pt").exists()
    assert metric == "accuracy" and data.y.shape == (600,) and data.y.dtype == torch.long
    assert data.x.shape == (600, 100) and data.num_edges == 2 * 3600
    assert [len(split[k]) for k in ("train", "val", "test")] == [360, 120, 120]
    final = train_offline_with_auto(tmp_path, 60, ("ogbn-products", "accuracy"))
    assert final["test_metric"] > 0.5  # 5 classes: chance is 0.2


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
    reference, reference_split, _ = gcn.ogbn_products(str(tmp_path))
    gcn.prepare_graph(reference, reference_split)  # what mp.spawn's ranks get
    saved = tmp_path / "ogbn_products" / "processed" / "sorted_for_ddp.pt"
    data, split, metric = gcn.load_dataset(args, mapped=True)
    assert saved.exists() and metric == "accuracy" and len(split["train"]) == 360
    for key in ("x", "edge_index", "y"):
        assert torch.equal(data[key], reference[key]), key
        assert mapped_from(data[key], saved), key
    written = saved.stat().st_mtime_ns
    again = gcn.load_dataset(args, mapped=True)[0]  # the next rank maps the same file
    assert saved.stat().st_mtime_ns == written and mapped_from(again.x, saved)
    # Processed again (a new download): the sorted copy is made again.
    processed = tmp_path / "ogbn_products" / "processed" / "geometric_data_processed.pt"
    os.utime(processed, ns=(written + 10**9, written + 10**9))
    gcn.load_dataset(args, mapped=True)
    assert saved.stat().st_mtime_ns > written


def test_when_the_sorted_copy_cannot_be_saved_each_rank_keeps_its_own(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ogb", reason="ogb is not installed (make setup installs it)")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    write_ogbn_products_raw(tmp_path)
    args = gcn.parse_args(["--dataset", "ogbn-products", "--data-dir", str(tmp_path)])
    gcn.ogbn_products(str(tmp_path))
    saved = tmp_path / "ogbn_products" / "processed" / "sorted_for_ddp.pt"
    (saved.parent / f"{saved.name}.{socket.gethostname()}.{os.getpid()}.part").mkdir()  # blocks the write
    data, split, _ = gcn.load_dataset(args, mapped=True)
    assert not saved.exists() and "each rank holds its own copy" in capsys.readouterr().out
    assert data.num_nodes == 600 and len(split["train"]) == 360
    assert bool((data.edge_index[1][1:] >= data.edge_index[1][:-1]).all())  # sorted all the same


def test_ogbn_products_offline_without_files_is_refused_and_leaves_nothing(tmp_path):
    pytest.importorskip("ogb", reason="ogb is not installed (make setup installs it)")
    r = run_script("gcn_ddp.py", *CPU, "--dataset", "ogbn-products", "--data-dir", tmp_path,
                   env=script_env(**OFFLINE), timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "ogbn-products is not in" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "ogbn_products").exists()  # or ogb would take it for an old release


def test_ogbn_products_without_ogb_says_what_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "ogb.nodeproppred.dataset_pyg", None)  # import fails
    with pytest.raises(gcn.UsageError, match="pip install ogb"):
        gcn.ogbn_products(str(tmp_path))


def test_bf16_autocast_on_cpu_trains_with_sampling_workers(tmp_path):
    out = tmp_path / "m.json"
    r = run_script("gcn_ddp.py", *CPU, "--nprocs", 2, *SMALL, "--epochs", 2, "--amp", "bf16",
                   "--num-workers", 1, "--metrics-json", out)
    assert r.returncode == 0, r.stderr
    metrics = read_metrics(out)
    assert metrics["amp"] == "bf16"
    assert metrics["epochs"][-1]["train_loss"] < metrics["epochs"][0]["train_loss"]
    assert metrics["epochs"][-1]["test_metric"] > 3 / 16


def test_fp16_on_cpu_is_refused(monkeypatch):
    assert "--amp fp16 needs a GPU" in refused(monkeypatch, [*CPU, "--amp", "fp16"])


def test_eval_subset_is_fixed_and_capped():
    idx = torch.arange(100, 200)
    assert gcn.eval_subset(idx, None, 0) is idx and gcn.eval_subset(idx, 500, 0) is idx
    a, b = gcn.eval_subset(idx, 30, 0), gcn.eval_subset(idx, 30, 0)
    assert torch.equal(a, b) and len(a.unique()) == 30 and set(a.tolist()) <= set(idx.tolist())


def test_batch_figure_assigns_hops_along_sampled_edges(tmp_path):
    import sys

    from conftest import REPO

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


@needs_gpu
@pytest.mark.parametrize("launch, amp", [("spawn", "off"), ("spawn", "bf16" if BF16 else "fp16"),
                                         ("torchrun", "off")])
def test_nccl_on_gpus(tmp_path, launch, amp):
    # As recommended on GPUs: sampling workers, forked by ranks that already hold a CUDA context.
    world, out = min(2, GPUS), tmp_path / "m.json"
    flags = ["--num-nodes", 20000, "--epochs", 2, "--num-workers", 2, "--amp", amp, "--metrics-json", out]
    if launch == "spawn":
        r = run_script("gcn_ddp.py", "--nprocs", world, *flags)
    else:
        r = run_script("gcn_ddp.py", *flags, launcher=torchrun(world))
    assert r.returncode == 0, r.stderr
    metrics = read_metrics(out)
    assert (metrics["world_size"], metrics["backend"], metrics["amp"]) == (world, "nccl", amp)
    losses = [e["train_loss"] for e in metrics["epochs"]]
    assert losses[1] < losses[0] and metrics["epochs"][-1]["test_metric"] > 3 / 16


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

    summed = sum(gcn.metric_sums(out[s], y[s]) for s in shards)
    whole = reference(out, y)
    assert gcn.metric_value(summed, multi_label) == pytest.approx(whole, abs=1e-12)
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
    """Under mp.spawn the graph goes to /dev/shm; with too little there (a container's 64 MB), one
    line says so, before any rank starts, instead of every rank dying of a bus error."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    free = {"bytes": 10 * 2**20}
    monkeypatch.setattr(gcn.shutil, "disk_usage", lambda path: type("usage", (), {"free": free["bytes"]}))
    message = refused(monkeypatch, [*CPU, "--nprocs", "2", "--num-nodes", "20000", "--max-steps", "1"])
    assert "MiB of shared memory and /dev/shm has 10 MiB free" in message and "--shm-size" in message
