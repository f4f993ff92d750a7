"""cpu/layers.py hc_enter / hc_leave (csrc/hyper.c) against layers/hyper_connection.py's torch forward, odd shapes,
float32 and bfloat16 streams; bad shapes named."""
from __future__ import annotations

import pytest
import torch

from wideep.cpu.build import unusable
from wideep.layers.hyper_connection import HyperConnection, HyperHead

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels: {unusable()}")


def _hc(H: int, n: int, iters: int, head: bool = False):
    torch.manual_seed(H * 7 + n + iters)
    m = HyperHead(H, n, 1e-6, 1e-6) if head else HyperConnection(H, n, iters, 1e-6, 1e-6)
    with torch.no_grad():
        m.fn.normal_(0, 0.2)
        m.base.normal_(0, 0.5)
        m.scale.copy_(1 + 0.3 * torch.randn_like(m.scale))
    return m


@pytest.mark.parametrize("T,n,H,iters", [(1, 4, 64, 20), (5, 4, 100, 20), (3, 3, 37, 1), (17, 2, 16, 0), (2, 4, 4096, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_enter_and_leave_equal_torch(T, n, H, iters, dtype):
    from wideep.cpu.layers import hc_enter, hc_leave
    m = _hc(H, n, iters)
    x = torch.randn(T, n, H).to(dtype)
    pre, post, comb = m.weights(x)
    y, pre_c, post_c, comb_c = hc_enter(x, m.fn, m.base, m.scale, iters, m.eps, m.norm_eps)
    torch.testing.assert_close(pre_c, pre, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post_c, post, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb_c, comb, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, HyperConnection.collapse(x, pre), **tol)
    assert y.dtype == dtype
    out = torch.randn(T, H).to(dtype)
    z = hc_leave(x, out, post, comb)
    ref = (post[..., None] * out.float()[:, None, :] + comb.transpose(1, 2) @ x.float())   # float32, one rounding
    torch.testing.assert_close(z.float(), ref.to(dtype).float(), **tol)
    assert z.dtype == dtype


@pytest.mark.parametrize("T,n,H", [(1, 4, 64), (6, 3, 50)])
def test_head_equals_torch(T, n, H):
    from wideep.cpu.layers import hc_enter
    m = _hc(H, n, 0, head=True)
    x = torch.randn(T, n, H)
    y, pre, post, comb = hc_enter(x, m.fn, m.base, m.scale, 0, m.eps, m.norm_eps, head=True)
    assert post is None and comb is None
    torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    from wideep.cpu.layers import hc_enter, hc_leave
    m = _hc(32, 4, 3)
    with pytest.raises(ValueError, match="fn must be contiguous"):
        hc_enter(torch.randn(2, 4, 32), m.fn[:, :64], m.base, m.scale, 3, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"streams must be .* \[T, n, H\]"):
        hc_enter(torch.randn(2, 128), m.fn, m.base, m.scale, 3, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="out must be"):
        hc_leave(torch.randn(2, 4, 32), torch.randn(2, 31), torch.rand(2, 4), torch.rand(2, 4, 4))
    with pytest.raises(ValueError, match="comb must be contiguous"):
        hc_leave(torch.randn(2, 4, 32), torch.randn(2, 32), torch.rand(2, 4), torch.rand(2, 4, 3))
