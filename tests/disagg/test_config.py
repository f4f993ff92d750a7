

def test_a_pool_has_its_own_node_layout():
    """A pool's nodes are those its ranks sit on (the two-level dispatcher sees the pool's layout, not
    the world's); an uneven pool runs as one flat node."""
    from wideep.disagg.roles import pool_nodes
    assert pool_nodes([4, 5, 6, 7], 2, 3) == dict(local_rank=1, local_world_size=2, node_rank=1, num_nodes=2)
    assert pool_nodes([0, 1], 4, 1) == dict(local_rank=1, local_world_size=2, node_rank=0, num_nodes=1)
    assert pool_nodes([1], 2, 0) == dict(local_rank=0, local_world_size=1, node_rank=0, num_nodes=1)
    assert pool_nodes([0, 2, 3], 2, 1) == dict(local_rank=1, local_world_size=3, node_rank=0, num_nodes=1)
