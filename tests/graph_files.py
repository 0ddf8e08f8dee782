"""Tiny graph datasets in the layouts their downloads unpack to (AmazonProducts, ogbn-products),
learnable: nodes of a class link mostly among themselves and share a feature direction. Lesson 4's
loaders must process them as the real ones."""


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
