"""What one collective sends, per rank: the one formula that the lessons and the tests use.

On a ring of N ranks (lesson 9), each rank sends N - 1 chunks of size/N in each of an all-reduce's
two phases: the reduce-scatter phase leaves each rank the sum of one chunk, the all-gather phase
sends those sums around. All-gather and reduce-scatter are each one of the two phases; NCCL's ring
algorithm runs them so. PyTorch's Gloo backend has no reduce-scatter of its own: it all-reduces the
whole input and keeps its chunk, so a reduce-scatter sends what an all-reduce does (measured in
lesson 10). A point-to-point send (a pipeline's activation, lesson 11) sends its bytes once.
"""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")
BACKENDS = ("nccl", "gloo")


def bytes_sent(collective, nbytes, n, backend="nccl"):
    """Bytes each of `n` ranks sends in one `collective` over `nbytes`, the size of the whole: the
    tensor all-reduced, the result of an all-gather, the input of a reduce-scatter, the tensor sent."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective {collective!r}: one of {', '.join(COLLECTIVES)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
    if n < 1 or nbytes < 0:
        raise ValueError(f"{n} ranks and {nbytes} bytes: give at least 1 rank and 0 bytes or more")
    if collective == "send":
        return float(nbytes)
    phases = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 2 if backend == "gloo" else 1}[collective]
    return phases * (n - 1) * nbytes / n
