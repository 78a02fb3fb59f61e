"""No silent misses (issue [robust] item 5): a chain a family starts to match either fuses or leaves a near-miss
whose check id and reason are true. Each case below differs from a fusable chain in one property.

(Most families' look-alikes live in their own tests/test_pass_<family>.py; this file holds the ones added for
[robust]: the RMSNorm whose eps sits outside the square root, and the cast round trip that rounds.)
"""

from __future__ import annotations

import unittest

import torch

import dsv41


def _compile_and_report(fn, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend="dsv41", dynamic=False)(*args)
    return got, dsv41.last_report().to_dict()


class EpsOutsideTheSquareRoot(unittest.TestCase):
    """mHC collapse followed by an RMSNorm spelled x / (sqrt(mean(x^2)) + eps) * w: the family must refuse it (it is
    another function for small x) and say that the eps is outside the square root, not that it is missing."""

    D = 32

    @staticmethod
    def collapse_then_norm(H, pre, w, eps_inside: bool):
        x = torch.einsum("btn,btnd->btd", pre, H)
        ms = x.pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(ms + 1e-6) if eps_inside else x / (ms.sqrt() + 1e-6)
        return y * w

    def run_case(self, eps_inside: bool):
        g = torch.Generator().manual_seed(3)
        H = torch.randn(1, 2, 4, self.D, generator=g)
        pre = torch.rand(1, 2, 4, generator=g)
        w = 0.5 + torch.rand(self.D, generator=g)
        got, report = _compile_and_report(lambda *a: self.collapse_then_norm(*a, eps_inside), H, pre, w)
        torch.testing.assert_close(got, self.collapse_then_norm(H, pre, w, eps_inside), rtol=1e-5, atol=1e-6)
        return report["families"]["mhc"]

    def test_eps_inside_fuses(self):
        fam = self.run_case(eps_inside=True)
        self.assertEqual([s["pattern"] for s in fam["sites"]], ["mhc_collapse_rmsnorm"])

    def test_eps_outside_is_named(self):
        fam = self.run_case(eps_inside=False)
        self.assertEqual(fam["matches"], 0)
        (miss,) = fam["near_misses"]
        self.assertEqual(miss["check"], "rms_eps")
        self.assertIn("outside the square root", miss["reason"])
        self.assertIn("1e-06", miss["reason"])
        self.assertNotIn("none of the region's literals", miss["reason"])


class CastRoundTrips(unittest.TestCase):
    """normalize removes a round trip through a dtype that holds every value, and names the one that rounds."""

    @staticmethod
    def two_round_trips(x):
        return x.to(torch.float64).to(torch.float32) + 1, x.to(torch.bfloat16).to(torch.float32) * 2

    def test_exact_round_trip_removed_rounding_one_reported(self):
        x = torch.randn(16, generator=torch.Generator().manual_seed(4))
        (exact, rounded), report = _compile_and_report(self.two_round_trips, x)
        want_exact, want_rounded = self.two_round_trips(x)
        self.assertTrue(torch.equal(exact, want_exact))
        self.assertTrue(torch.equal(rounded, want_rounded))  # the rounding happened, as in eager
        fam = report["families"]["normalize"]
        checks = [(m["check"], m["location"]["code"]) for m in fam["near_misses"]]
        self.assertEqual(len(checks), 1, checks)
        self.assertEqual(checks[0][0], "cast_rounds")
        self.assertIn("bfloat16", fam["near_misses"][0]["reason"])


class NormaliseThenProjectEpsOutside(unittest.TestCase):
    """mHC coefficients in the 'normalise, then project' spelling with the eps outside the square root: refused
    with the eps's place named (the spelling with the eps inside fuses: tests/test_pass_mhc_spellings.py)."""

    def test_named(self):
        g = torch.Generator().manual_seed(8)
        d = 16
        H = torch.randn(1, 1, 4, d, generator=g)
        fn = torch.randn(24, 4 * d, generator=g) / 8
        base, scale = torch.randn(24, generator=g), 0.5 + torch.rand(3, generator=g)

        def coefficients(H, fn, base, scale):
            z = H.flatten(2).float()
            m = torch.nn.functional.linear(z / (z.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6), fn)
            pre = torch.sigmoid(m[..., :4] * scale[0] + base[:4]) + 1e-6
            post = 2 * torch.sigmoid(m[..., 4:8] * scale[1] + base[4:8])
            c = torch.softmax((m[..., 8:] * scale[2] + base[8:]).unflatten(-1, (4, 4)), -1) + 1e-6
            c = c / (c.sum(-2, keepdim=True) + 1e-6)
            for _ in range(3):
                c = c / (c.sum(-1, keepdim=True) + 1e-6)
                c = c / (c.sum(-2, keepdim=True) + 1e-6)
            return pre, post, c

        got, report = _compile_and_report(coefficients, H, fn, base, scale)
        for a, b in zip(got, coefficients(H, fn, base, scale)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        fam = report["families"]["mhc"]
        self.assertEqual(fam["matches"], 0)
        (miss,) = fam["near_misses"]
        self.assertEqual(miss["check"], "rms_eps")
        self.assertIn("outside the square root", miss["reason"])
