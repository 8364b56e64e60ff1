"""The peers' own test suites, ported case by case (issue 29, section 1).

Sources (JAX's repository, ``tests/``):

- ``debug_nans_test.py``: ``DebugNaNsTest`` and ``DebugInfsTest``, the tests of ``jax_debug_nans`` and
  ``jax_debug_infs``;
- ``checkify_test.py``: the NaN/Inf/division cases of ``CheckifyTransformTests`` and
  ``AssertPrimitiveTests`` (float and nan checks, div-by-zero, cond/scan/while bodies, custom_jvp/custom_vjp,
  vmap, pmap, shard_map).

Each case is rewritten minimally (no upstream code is copied) and cites its test as ``Class.method``. Where
an upstream test only covers a mechanism in one direction (an ``inf`` fed in as data, a single device), a
variant is added and says so (``variant of ...``). The line where the non-finite value is born, as a user
would want it named, carries a ``# ORIGIN`` comment: a computation (``forward`` or ``backward`` pass), or a
non-finite constant written in the program (``literal``). Input cases (NaN/Inf passed in as data) have no
``# ORIGIN`` line: the answer is "the input". Clean and masked cases must produce no alarm; a masked case
makes a NaN/Inf on purpose that never reaches the outputs.

Every builder is called with no argument and returns ``(fn, args)``: ``fn`` is what a user would call (a
jitted function, a gradient, a pmapped function), ``args`` its exact inputs (Python floats stay Python
floats, as in the tests). Builders may warm ``fn`` up first (the upstream tests do, to go past jit's cache
miss path); that runs with the debug flags off.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from functools import partial

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import (
    NamedSharding,  # noqa: E402
    PartitionSpec as P,  # noqa: E402
)

DN = "debug_nans_test.py"
CK = "checkify_test.py"
KINDS = ("nonfinite", "clean", "masked", "input")
PHASES = ("forward", "backward", "update", "input", "literal", "none")


@dataclasses.dataclass
class Case:
    name: str
    source: str  # "debug_nans_test.py DebugNaNsTest.testJitComputationNaN"
    kind: str  # nonfinite / clean / masked / input
    phase: str  # forward / backward / update / input / literal / none
    build: Callable[[], tuple]
    devices: int = 1  # devices the case needs
    note: str = ""

    @property
    def origin_line(self) -> int | None:
        """The line of this file marked ``# ORIGIN`` in the builder (None for input/clean/masked cases)."""
        lines, start = inspect.getsourcelines(self.build)
        marked = [start + i for i, text in enumerate(lines) if "# ORIGIN" in text]
        return marked[0] if marked else None


CASES: list[Case] = []


def case(source: str, kind: str, phase: str, devices: int = 1, note: str = "", name: str | None = None):
    assert kind in KINDS and phase in PHASES, (kind, phase)

    def register(build):
        CASES.append(Case(name or build.__name__, source, kind, phase, build, devices, note))
        return build

    return register


def _mesh(n: int) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))


# ============================================================================= debug_nans_test.py: DebugNaNsTest


@case(f"{DN} DebugNaNsTest.testSinc", "clean", "none")
def dn_sinc_at_zero():
    return jnp.sinc, (0.0,)


@case(f"{DN} DebugNaNsTest.testSingleResultPrimitiveNoNaN", "clean", "none")
def dn_tanh_no_nan():
    return jnp.tanh, (jnp.array([[1.0, 2.0], [2.0, 3.0]]),)


@case(f"{DN} DebugNaNsTest.testMultipleResultPrimitiveNoNaN", "clean", "none")
def dn_eigh_no_nan():
    return (lambda a: jnp.linalg.eigh(a)[0]), (jnp.array([[1.0, 2.0], [2.0, 3.0]]),)


@case(f"{DN} DebugNaNsTest.testJitComputationNoNaN", "clean", "none")
def dn_jit_tanh_no_nan():
    return jax.jit(jnp.tanh), (jnp.array([[1.0, 2.0], [2.0, 3.0]]),)


@case(f"{DN} DebugNaNsTest.testJitComputationNaN", "nonfinite", "forward")
def dn_jit_zero_over_zero():
    f = jax.jit(lambda x: 0.0 / x)  # ORIGIN
    return f, (jnp.array(0.0),)


@case(f"{DN} DebugNaNsTest.testJitComputationNaNContextManager", "nonfinite", "forward")
def dn_jit_zero_over_zero_cached():
    f = jax.jit(lambda x: 0.0 / x)  # ORIGIN
    a = jnp.array(0.0)
    f(a), f(a)  # compiled and cached before the flag is turned on
    return f, (a,)


@case(f"{DN} DebugNaNsTest.testSingleResultPrimitiveNaN", "nonfinite", "forward")
def dn_eager_zero_over_zero():
    def f(a):
        return 0.0 / a  # ORIGIN

    return f, (jnp.array(0.0),)


@case(f"{DN} DebugNaNsTest.testCallDeoptimized[jit]", "nonfinite", "literal")
def dn_cond_nan_literal_jit():
    @jax.jit
    def f(x):
        return lax.cond(x == 1, lambda _: np.nan, lambda _: 2.0, operand=None)  # ORIGIN

    f(2)
    return f, (1,)


@case(f"{DN} DebugNaNsTest.testCallDeoptimized[noop]", "nonfinite", "literal")
def dn_cond_nan_literal_eager():
    def f(x):
        return lax.cond(x == 1, lambda _: np.nan, lambda _: 2.0, operand=None)  # ORIGIN

    return f, (1,)


@case(f"{DN} DebugNaNsTest.testCallDeoptimized[jit] (the f(2) call)", "clean", "none")
def dn_cond_nan_literal_untaken():
    @jax.jit
    def f(x):
        return lax.cond(x == 1, lambda _: np.nan, lambda _: 2.0, operand=None)

    return f, (2,)


@case(f"{DN} DebugNaNsTest.testShardMap (1 device)", "nonfinite", "forward")
def dn_shard_map_one_device():
    f = jax.shard_map(lambda x: 0.0 / x, mesh=_mesh(1), in_specs=P("x"), out_specs=P("x"))  # ORIGIN
    f(jnp.array([1.0]))
    return f, (jnp.array([0.0]),)


@case(f"{DN} DebugNaNsTest.testShardMap (2 devices)", "nonfinite", "forward", devices=2)
def dn_shard_map_two_devices():
    f = jax.shard_map(lambda x: 0.0 / x, mesh=_mesh(2), in_specs=P("x"), out_specs=P("x"))  # ORIGIN
    return f, (jnp.array([1.0, 0.0]),)


@case(f"{DN} DebugNaNsTest.testShardMap (the f([1.]) call)", "clean", "none")
def dn_shard_map_clean():
    f = jax.shard_map(lambda x: 0.0 / x, mesh=_mesh(1), in_specs=P("x"), out_specs=P("x"))
    return f, (jnp.array([1.0]),)


@case(f"{DN} DebugNaNsTest.testPmap (1 device)", "nonfinite", "forward")
def dn_pmap_one_device():
    f = jax.pmap(lambda x: 0.0 / x)  # ORIGIN
    f(jnp.array([1.0]))
    return f, (jnp.array([0.0]),)


@case(f"{DN} DebugNaNsTest.testPmap (2 devices)", "nonfinite", "forward", devices=2)
def dn_pmap_two_devices():
    f = jax.pmap(lambda x: 0.0 / x)  # ORIGIN
    return f, (jnp.array([1.0, 0.0]),)


@case(f"{DN} DebugNaNsTest.testPmapNoNaN", "clean", "none")
def dn_pmap_no_nan():
    return jax.pmap(lambda x: 0.0 / x), (jnp.array([1.0]),)


@case(f"{DN} DebugNaNsTest.testGradPmap", "nonfinite", "backward")
def dn_grad_pmap():
    @jax.jit
    def f(x):
        y = x**2
        return jnp.log(y)  # ORIGIN

    def pullback(x, ct):
        return jax.vjp(jax.pmap(f), x)[1](ct)[0]

    return pullback, (jnp.zeros([1]), jnp.ones([1]))


@case(f"{DN} DebugNaNsTest.testGradPmap (variant: 2 devices)", "nonfinite", "backward", devices=2)
def dn_grad_pmap_two_devices():
    @jax.jit
    def f(x):
        y = x**2
        return jnp.log(y)  # ORIGIN

    def pullback(x, ct):
        return jax.vjp(jax.pmap(f), x)[1](ct)[0]

    return pullback, (jnp.array([1.0, 0.0]), jnp.ones([2]))


@case(f"{DN} DebugNaNsTest.testGradShardMap", "nonfinite", "backward")
def dn_grad_shard_map():
    @jax.jit
    def f(x):
        y = x**2
        return jnp.log(y)  # ORIGIN

    g = jax.shard_map(f, mesh=_mesh(1), in_specs=P("x"), out_specs=P("x"))

    def pullback(x, ct):
        return jax.vjp(g, x)[1](ct)[0]

    return pullback, (jnp.zeros([1]), jnp.ones([1]))


@case(f"{DN} DebugNaNsTest.testGradShardMap (variant: 2 devices)", "nonfinite", "backward", devices=2)
def dn_grad_shard_map_two_devices():
    @jax.jit
    def f(x):
        y = x**2
        return jnp.log(y)  # ORIGIN

    g = jax.shard_map(f, mesh=_mesh(2), in_specs=P("x"), out_specs=P("x"))

    def pullback(x, ct):
        return jax.vjp(g, x)[1](ct)[0]

    return pullback, (jnp.array([1.0, 0.0]), jnp.ones([2]))


@case(f"{DN} DebugNaNsTest.test_jit", "nonfinite", "forward", devices=2)
def dn_jit_sharded():
    s = NamedSharding(_mesh(2), P("x"))
    f = jax.jit(lambda x: 0.0 / x, in_shardings=s, out_shardings=s)  # ORIGIN
    return f, (jnp.array([0.0, 1.0]),)


@case(f"{DN} DebugNaNsTest.testDebugNansJitWithDonation", "nonfinite", "forward")
def dn_jit_donation():
    f = jax.jit(lambda x: 0.0 / x, donate_argnums=(0,))  # ORIGIN
    return f, (jnp.array(0.0),)


@case(f"{DN} DebugNaNsTest.testDebugNansPmapWithDonation", "nonfinite", "forward")
def dn_pmap_donation():
    f = jax.pmap(lambda x: 0.0 / x, donate_argnums=(0,))  # ORIGIN
    return f, (jnp.zeros((1,)),)


@case(f"{DN} DebugNaNsTest.testDebugNansJitWithDonationSharded", "nonfinite", "forward", devices=2)
def dn_jit_donation_sharded():
    s = NamedSharding(_mesh(2), P("x"))
    f = jax.jit(lambda x: 0.0 / x, in_shardings=s, out_shardings=s, donate_argnums=(0,))  # ORIGIN
    return f, (jnp.array([0.0, 1.0]),)


@case(f"{DN} DebugNaNsTest.testDebugNansZeroDiv (eager)", "nonfinite", "forward")
def dn_zero_div_eager():
    def f(x, y):
        return x / y  # ORIGIN

    return f, (jnp.zeros(()), jnp.zeros(()))


@case(f"{DN} DebugNaNsTest.testDebugNansZeroDiv (jit)", "nonfinite", "forward")
def dn_zero_div_jit():
    def f(x, y):
        return x / y  # ORIGIN

    return jax.jit(f), (jnp.zeros(()), jnp.zeros(()))


@case(f"{DN} DebugNaNsTest.testDebugNansInput", "input", "input", note="NaN passed as a Python float")
def dn_input_python_float():
    @jax.jit
    def f(x):
        return x * 3.0

    return f, (np.nan,)


@case(f"{DN} DebugNaNsTest.testDebugNansInput (variant: a jax array)", "input", "input")
def dn_input_array():
    @jax.jit
    def f(x):
        return x * 3.0

    return f, (jnp.array(np.nan),)


# ============================================================================= debug_nans_test.py: DebugInfsTest


@case(f"{DN} DebugInfsTest.testSingleResultPrimitiveNoInf", "clean", "none")
def di_tanh_no_inf():
    return jnp.tanh, (jnp.array([[1.0, 2.0], [2.0, 3.0]]),)


@case(f"{DN} DebugInfsTest.testMultipleResultPrimitiveNoInf", "clean", "none")
def di_eigh_no_inf():
    return (lambda a: jnp.linalg.eigh(a)[0]), (jnp.array([[1.0, 2.0], [2.0, 3.0]]),)


@case(f"{DN} DebugInfsTest.testJitComputationNoInf", "clean", "none")
def di_jit_tanh_no_inf():
    return jax.jit(jnp.tanh), (jnp.array([[1.0, 2.0], [2.0, 3.0]]),)


@case(f"{DN} DebugInfsTest.testSingleResultPrimitiveInf", "nonfinite", "forward")
def di_eager_one_over_zero():
    def f(a):
        return 1.0 / a  # ORIGIN

    return f, (jnp.array(0.0),)


@case(f"{DN} DebugInfsTest.testCallDeoptimized[jit]", "nonfinite", "literal")
def di_cond_inf_literal_jit():
    @jax.jit
    def f(x):
        return lax.cond(x == 1, lambda _: np.inf, lambda _: 2.0, operand=None)  # ORIGIN

    f(2)
    return f, (1,)


@case(f"{DN} DebugInfsTest.testCallDeoptimized[noop]", "nonfinite", "literal")
def di_cond_inf_literal_eager():
    def f(x):
        return lax.cond(x == 1, lambda _: np.inf, lambda _: 2.0, operand=None)  # ORIGIN

    return f, (1,)


@case(f"{DN} DebugInfsTest.testCallDeoptimized (variant: array predicate)", "nonfinite", "literal")
def di_cond_inf_literal_traced_pred():
    @jax.jit
    def f(x):
        return lax.cond(x == 1, lambda _: np.inf, lambda _: 2.0, operand=None)  # ORIGIN

    return f, (jnp.array(1),)


@case(f"{DN} DebugInfsTest.testCallDeoptimized (variant: lax.switch)", "nonfinite", "literal")
def di_switch_inf_literal():
    @jax.jit
    def f(i, x):
        return lax.switch(i, [lambda v: v * 2.0, lambda v: v + jnp.inf], x)  # ORIGIN

    return f, (jnp.array(1), jnp.array(1.0))


@case(f"{DN} DebugInfsTest.testDebugNansDoesntCorruptCaches", "nonfinite", "backward")
def di_grad_x_over_x():
    @jax.jit
    def f(x):
        return jnp.divide(x, x)  # ORIGIN

    return jax.grad(f), (0.0,)


@case(f"{DN} DebugInfsTest.testDebugNansDoesntReturnDeoptimizedResult", "nonfinite", "literal")
def di_jit_returns_nan_literal():
    @jax.jit
    def f(x):
        y = x + 2
        return jnp.nan, y  # ORIGIN

    return f, (3,)


@case(
    f"{DN} DebugInfsTest.testDebugNansDoesntReturnDeoptimizedResult (variant: jnp.inf, array input)",
    "nonfinite",
    "literal",
)
def di_jit_returns_inf_literal():
    @jax.jit
    def f(x):
        y = x + 2.0
        return y * jnp.inf  # ORIGIN

    return f, (jnp.array(3.0),)


# ============================================================================= checkify_test.py


@case(f"{CK} CheckifyTransformTests.test_jit_nan (no error)", "clean", "none")
def ck_sin_sum_clean():
    def f(x1, x2):
        return jnp.sin(x1) + jnp.sin(x2)

    return jax.jit(f), (3.0, 4.0)


@case(f"{CK} CheckifyTransformTests.test_jit_nan[jit=False]", "input", "input")
def ck_sin_of_inf_input():
    def f(x1, x2):
        return jnp.sin(x1) + jnp.sin(x2)

    return f, (3.0, jnp.inf)


@case(f"{CK} CheckifyTransformTests.test_jit_nan[jit=True]", "input", "input")
def ck_sin_of_inf_input_jit():
    def f(x1, x2):
        return jnp.sin(x1) + jnp.sin(x2)

    return jax.jit(f), (jnp.array(3.0), jnp.array(jnp.inf))


@case(f"{CK} CheckifyTransformTests.test_jit_nan (variant: the inf made inside)", "nonfinite", "forward")
def ck_sin_of_made_inf():
    def f(x1, x2):
        big = jnp.exp(x2)  # ORIGIN
        return jnp.sin(x1) + jnp.sin(big)

    return jax.jit(f), (jnp.array(3.0), jnp.array(100.0))


@case(f"{CK} CheckifyTransformTests.test_jit_div_errors (no error)", "clean", "none")
def ck_div_clean():
    return jax.jit(lambda x, y: x / y), (jnp.ones((3,)), jnp.ones((3,)))


@case(f"{CK} CheckifyTransformTests.test_jit_div_errors[jit=False]", "nonfinite", "forward")
def ck_div_by_zero_eager():
    def f(x, y):
        return x / y  # ORIGIN

    return f, (jnp.ones((3,)), jnp.array([1.0, 0.0, 1.0]))


@case(f"{CK} CheckifyTransformTests.test_jit_div_errors[jit=True]", "nonfinite", "forward")
def ck_div_by_zero_jit():
    def f(x, y):
        return x / y  # ORIGIN

    return jax.jit(f), (jnp.ones((3,)), jnp.array([1.0, 0.0, 1.0]))


@case(f"{CK} CheckifyTransformTests.test_jit_div_errors (inf / inf)", "input", "input")
def ck_div_inf_by_inf_input():
    def f(x, y):
        return x / y

    return jax.jit(f), (jnp.array([1, jnp.inf, 1]), jnp.array([1, jnp.inf, 1]))


@case(f"{CK} CheckifyTransformTests.test_jit_multi (no error: the inf is not indexed)", "masked", "none")
def ck_multi_inf_not_indexed():
    def f(x, i):
        return jnp.cos(x[i])

    return jax.jit(f), (jnp.array([0.0, jnp.inf, 2.0]), 2)


@case(f"{CK} CheckifyTransformTests.test_jit_multi (nan error)", "input", "input")
def ck_multi_cos_of_inf_input():
    def f(x, i):
        return jnp.cos(x[i])

    return jax.jit(f), (jnp.array([0.0, 1.0, jnp.inf]), 2)


@case(f"{CK} CheckifyTransformTests.test_jit_ordering", "input", "input")
def ck_ordering_inf_input():
    def f(x, i):
        return x[i] * jnp.sin(x)

    return jax.jit(f), (jnp.array([0.0, 1.0, jnp.inf]), 5)


@case(f"{CK} CheckifyTransformTests.test_pmap_basic (no error)", "clean", "none", devices=2)
def ck_pmap_clean():
    @jax.pmap
    def f(x):
        return jnp.sin(1.0 / x) + jnp.sin(x)

    return f, (jnp.array([1.0, 2.0]),)


@case(f"{CK} CheckifyTransformTests.test_pmap_basic", "nonfinite", "forward", devices=2)
def ck_pmap_sin_one_over_zero():
    @jax.pmap
    def f(x):
        y1 = jnp.sin(1.0 / x)  # ORIGIN
        y2 = jnp.sin(x)
        return y1 + y2

    return f, (jnp.array([3.0, 0.0]),)


@case(f"{CK} CheckifyTransformTests.test_pmap_collectives", "clean", "none", devices=4)
def ck_pmap_all_gather_clean():
    f = jax.pmap(lambda x: lax.all_gather(x, axis_name="i"), axis_name="i")
    return f, (jnp.array([0.0, 2.0, 3.0, 6.0]),)


@case(f"{CK} CheckifyTransformTests.test_cond_basic (no error)", "clean", "none")
def ck_cond_clean():
    @jax.jit
    def f(x):
        return lax.cond(x > 0, jnp.sin, lambda v: v / 0.0, x)

    return f, (jnp.array(3.0),)


@case(f"{CK} CheckifyTransformTests.test_cond_basic (nan in true branch)", "input", "input")
def ck_cond_sin_of_inf_input():
    @jax.jit
    def f(x):
        return lax.cond(x > 0, jnp.sin, lambda v: v / 0.0, x)

    return f, (jnp.array(jnp.inf),)


@case(f"{CK} CheckifyTransformTests.test_cond_basic (-inf)", "input", "input")
def ck_cond_minus_inf_input():
    @jax.jit
    def f(x):
        return lax.cond(x > 0, jnp.sin, lambda v: v / 0.0, x)

    return f, (jnp.array(-jnp.inf),)


@case(f"{CK} CheckifyTransformTests.test_cond_basic (division by zero)", "nonfinite", "forward")
def ck_cond_div_by_zero():
    @jax.jit
    def f(x):
        def true_fun(v):
            return jnp.sin(v)

        def false_fun(v):
            return v / 0.0  # ORIGIN

        return lax.cond(x > 0, true_fun, false_fun, x)

    return f, (jnp.array(0.0),)


@case(f"{CK} CheckifyTransformTests.test_cond_basic (variant: under vmap)", "nonfinite", "forward")
def ck_cond_div_by_zero_vmap():
    def f(x):
        def true_fun(v):
            return jnp.sin(v)

        def false_fun(v):
            return v / 0.0  # ORIGIN

        return lax.cond(x > 0, true_fun, false_fun, x)

    return jax.jit(jax.vmap(f)), (jnp.array([3.0, 0.0]),)


@case(f"{CK} CheckifyTransformTests.test_cond_basic (variant: under vmap, masked)", "masked", "none")
def ck_cond_vmap_masked():
    def f(x):
        return lax.cond(x > 0, jnp.sin, lambda v: v / 0.0, x)  # the 3/0 of the untaken branch is selected away

    return jax.jit(jax.vmap(f)), (jnp.array([3.0, 2.0]),)


@case(f"{CK} CheckifyTransformTests.test_scan_map (no error)", "clean", "none")
def ck_scan_map_clean():
    @jax.jit
    def f(xs):
        return lax.scan(lambda c, x: (c, jnp.sin(x)), None, xs)[1]

    return f, (jnp.array([0.0, 2.0]),)


@case(f"{CK} CheckifyTransformTests.test_scan_map", "input", "input")
def ck_scan_map_inf_input():
    @jax.jit
    def f(xs):
        return lax.scan(lambda c, x: (c, jnp.sin(x)), None, xs)[1]

    return f, (jnp.array([3.0, jnp.inf]),)


def _scan_carry_body(carry, x):
    carry = carry - 1.0
    possible_nan = jnp.sin(1.0 / carry)
    return carry, x + possible_nan


@case(f"{CK} CheckifyTransformTests.test_scan_carry (no error)", "clean", "none")
def ck_scan_carry_clean():
    return jax.jit(lambda c, xs: lax.scan(_scan_carry_body, c, xs)), (3.0, jnp.ones((2,)))


@case(f"{CK} CheckifyTransformTests.test_scan_carry (first iteration)", "nonfinite", "forward")
def ck_scan_carry_first_iteration():
    def body(carry, x):
        carry = carry - 1.0
        possible_nan = jnp.sin(1.0 / carry)  # ORIGIN
        return carry, x + possible_nan

    return jax.jit(lambda c, xs: lax.scan(body, c, xs)), (1.0, jnp.ones((2,)))


@case(f"{CK} CheckifyTransformTests.test_scan_carry (second iteration)", "nonfinite", "forward")
def ck_scan_carry_second_iteration():
    def body(carry, x):
        carry = carry - 1.0
        possible_nan = jnp.sin(1.0 / carry)  # ORIGIN
        return carry, x + possible_nan

    return jax.jit(lambda c, xs: lax.scan(body, c, xs)), (2.0, jnp.ones((4,)))


@case(f"{CK} CheckifyTransformTests.test_scan_carry (variant: under vmap)", "nonfinite", "forward")
def ck_scan_carry_vmap():
    def body(carry, x):
        carry = carry - 1.0
        possible_nan = jnp.sin(1.0 / carry)  # ORIGIN
        return carry, x + possible_nan

    f = jax.vmap(lambda c, xs: lax.scan(body, c, xs), in_axes=(0, None))
    return jax.jit(f), (jnp.array([3.5, 2.0]), jnp.ones((3,)))


@case(f"{CK} CheckifyTransformTests.test_scan_carry (variant: its gradient)", "nonfinite", "forward")
def ck_scan_carry_grad():
    def body(carry, x):
        carry = carry - 1.0
        possible_nan = jnp.sin(1.0 / carry)  # ORIGIN
        return carry, x + possible_nan

    def loss(c, xs):
        return jnp.sum(lax.scan(body, c, xs)[1])

    return jax.jit(jax.grad(loss)), (jnp.array(2.0), jnp.ones((3,)))


@case(f"{CK} CheckifyTransformTests.test_while_loop_body_error (no error)", "clean", "none")
def ck_while_body_clean():
    def body(val):
        i, x = val
        return i + 1.0, x + jnp.sin(1.0 / i)

    return jax.jit(lambda v: lax.while_loop(lambda s: s[0] < 2, body, (v, 0.0))), (1.0,)


@case(f"{CK} CheckifyTransformTests.test_while_loop_body_error", "nonfinite", "forward")
def ck_while_body_div_by_zero():
    def body(val):
        i, x = val
        possible_nan = jnp.sin(1.0 / i)  # ORIGIN
        return i + 1.0, x + possible_nan

    return jax.jit(lambda v: lax.while_loop(lambda s: s[0] < 2, body, (v, 0.0))), (0.0,)


@case(f"{CK} CheckifyTransformTests.test_while_loop_body_error (variant: under vmap)", "nonfinite", "forward")
def ck_while_body_div_by_zero_vmap():
    def body(val):
        i, x = val
        possible_nan = jnp.sin(1.0 / i)  # ORIGIN
        return i + 1.0, x + possible_nan

    f = jax.vmap(lambda v: lax.while_loop(lambda s: s[0] < 2, body, (v, 0.0)))
    return jax.jit(f), (jnp.array([1.0, 0.0]),)


@case(f"{CK} CheckifyTransformTests.test_while_loop_cond_error (no error)", "clean", "none")
def ck_while_cond_clean():
    def cond(val):
        s = jnp.sin(1.0 / val)
        return 0.0 * s + val < 2.0

    return jax.jit(lambda v: lax.while_loop(cond, lambda v: v + 1.0, v)), (1.0,)


@case(
    f"{CK} CheckifyTransformTests.test_while_loop_cond_error",
    "masked",
    "none",
    note="the NaN lives in the loop predicate only; the output is finite",
)
def ck_while_cond_nan_masked():
    def cond(val):
        s = jnp.sin(1.0 / val)
        return 0.0 * s + val < 2.0

    return jax.jit(lambda v: lax.while_loop(cond, lambda v: v + 1.0, v)), (0.0,)


@case(f"{CK} CheckifyTransformTests.test_while_loop_cond_error_and_false (first cond)", "masked", "none")
def ck_while_cond_false_first():
    def cond(val):
        return jnp.logical_not(jnp.isnan(jnp.sin(1.0 / val)))

    return jax.jit(lambda v: lax.while_loop(cond, lambda v: v - 1, v)), (0.0,)


@case(f"{CK} CheckifyTransformTests.test_while_loop_cond_error_and_false (second cond)", "masked", "none")
def ck_while_cond_false_second():
    def cond(val):
        return jnp.logical_not(jnp.isnan(jnp.sin(1.0 / val)))

    return jax.jit(lambda v: lax.while_loop(cond, lambda v: v - 1, v)), (1.0,)


def _while_body_and_cond(cond_val, body_val):
    def cond(val):
        i, c, _ = val
        return i + 0.0 * jnp.sin(c) < 2

    def body(val):
        i, c, b = val
        return i + 1.0, c, jnp.cos(b)

    return lax.while_loop(cond, body, (0.0, cond_val, body_val))


@case(f"{CK} CheckifyTransformTests.test_while_loop_body_and_cond_error (cond inf)", "input", "input")
def ck_while_body_and_cond_inf_cond():
    return jax.jit(_while_body_and_cond), (jnp.inf, 1.0)


@case(f"{CK} CheckifyTransformTests.test_while_loop_body_and_cond_error (body inf)", "input", "input")
def ck_while_body_and_cond_inf_body():
    return jax.jit(_while_body_and_cond), (1.0, jnp.inf)


@case(f"{CK} CheckifyTransformTests.test_while_loop_body_and_cond_error (both inf)", "input", "input")
def ck_while_body_and_cond_inf_both():
    return jax.jit(_while_body_and_cond), (jnp.array(jnp.inf), jnp.array(jnp.inf))


@case(f"{CK} CheckifyTransformTests.test_checkify_jit (unary x / x)", "nonfinite", "forward", devices=8)
def ck_sharded_jit_x_over_x():
    s = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:8]), ("dev",)), P("dev"))

    def f(x):
        return x / x  # ORIGIN

    return jax.jit(f, in_shardings=s, out_shardings=s), (jax.device_put(np.arange(8), s),)


@case(f"{CK} CheckifyTransformTests.test_checkify_jit (binary x / y)", "nonfinite", "forward", devices=8)
def ck_sharded_jit_x_over_y():
    s = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:8]), ("dev",)), P("dev"))

    def g(x, y):
        return x / y  # ORIGIN

    x = jax.device_put(np.arange(8), s)
    return jax.jit(g, in_shardings=(s, s), out_shardings=s), (x, x)


def _shard_map_case(binary: bool, check_vma: bool):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("dev",))
    s = NamedSharding(mesh, P("dev"))
    x = jax.device_put(np.tile(np.arange(4, dtype=np.int32), 2), s)
    return mesh, s, x


@case(f"{CK} CheckifyTransformTests.test_shard_map[check_vma=True] (unary)", "nonfinite", "forward", devices=8)
def ck_shard_map_unary_vma():
    mesh, s, x = _shard_map_case(False, True)

    def f(v):
        return lax.axis_index("dev") * v / v  # ORIGIN

    f = jax.shard_map(f, mesh=mesh, in_specs=P("dev"), out_specs=P("dev"), check_vma=True)
    return jax.jit(f, in_shardings=s, out_shardings=s), (x,)


@case(f"{CK} CheckifyTransformTests.test_shard_map[check_vma=False] (unary)", "nonfinite", "forward", devices=8)
def ck_shard_map_unary_no_vma():
    mesh, s, x = _shard_map_case(False, False)

    def f(v):
        return lax.axis_index("dev") * v / v  # ORIGIN

    f = jax.shard_map(f, mesh=mesh, in_specs=P("dev"), out_specs=P("dev"), check_vma=False)
    return jax.jit(f, in_shardings=s, out_shardings=s), (x,)


@case(f"{CK} CheckifyTransformTests.test_shard_map[check_vma=True] (binary)", "nonfinite", "forward", devices=8)
def ck_shard_map_binary_vma():
    mesh, s, x = _shard_map_case(True, True)

    def g(v, w):
        return lax.axis_index("dev") * v / w  # ORIGIN

    g = jax.shard_map(g, mesh=mesh, in_specs=(P("dev"), P("dev")), out_specs=P("dev"), check_vma=True)
    return jax.jit(g, in_shardings=(s, s), out_shardings=s), (x, x)


@case(f"{CK} CheckifyTransformTests.test_shard_map[check_vma=False] (binary)", "nonfinite", "forward", devices=8)
def ck_shard_map_binary_no_vma():
    mesh, s, x = _shard_map_case(True, False)

    def g(v, w):
        return lax.axis_index("dev") * v / w  # ORIGIN

    g = jax.shard_map(g, mesh=mesh, in_specs=(P("dev"), P("dev")), out_specs=P("dev"), check_vma=False)
    return jax.jit(g, in_shardings=(s, s), out_shardings=s), (x, x)


@case(f"{CK} CheckifyTransformTests.test_shard_map (variant: finite data)", "clean", "none", devices=8)
def ck_shard_map_clean():
    mesh, s, _ = _shard_map_case(False, True)

    def f(v):
        return lax.axis_index("dev") * v / v

    f = jax.shard_map(f, mesh=mesh, in_specs=P("dev"), out_specs=P("dev"))
    return jax.jit(f, in_shardings=s, out_shardings=s), (jax.device_put(np.arange(1, 9, dtype=np.int32), s),)


@case(f"{CK} CheckifyTransformTests.test_enabled_errors", "nonfinite", "forward")
def ck_multi_errors():
    def multi_errors(x):
        x = x / 0  # ORIGIN
        x = jnp.sin(x)
        return x[500]

    return multi_errors, (jnp.ones((2,)),)


@case(f"{CK} CheckifyTransformTests.test_post_process_call", "nonfinite", "literal")
def ck_post_process_call():
    def g(x):
        @jax.jit
        def f(y):
            return jnp.sin(x * y)

        return f(jnp.inf)  # ORIGIN

    return g, (2.0,)


@case(f"{CK} CheckifyTransformTests.test_post_process_map", "nonfinite", "literal")
def ck_post_process_map():
    def g(x):
        @jax.pmap
        def f(y):
            return jnp.sin(x * y), jnp.cos(x * y)

        return f(jnp.array([jnp.inf]))[0]  # ORIGIN

    return g, (jnp.array(2.0),)


@case(f"{CK} CheckifyTransformTests.test_custom_jvp (no error)", "clean", "none")
def ck_custom_jvp_clean():
    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    @sin.defjvp
    def sin_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return sin(x), jnp.cos(x) * xdot

    return jax.grad(sin), (3.0,)


@case(f"{CK} CheckifyTransformTests.test_custom_jvp (primal)", "input", "input")
def ck_custom_jvp_inf_input():
    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    @sin.defjvp
    def sin_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return sin(x), jnp.cos(x) * xdot

    return sin, (jnp.inf,)


@case(f"{CK} CheckifyTransformTests.test_custom_jvp (checkify of jvp)", "input", "input")
def ck_custom_jvp_of_jvp_inf_input():
    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    @sin.defjvp
    def sin_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return sin(x), jnp.cos(x) * xdot

    return (lambda x, xdot: jax.jvp(sin, (x,), (xdot,))), (jnp.array(jnp.inf), jnp.array(1.0))


@case(f"{CK} CheckifyTransformTests.test_custom_jvp (variant: the primal blows up)", "nonfinite", "forward")
def ck_custom_jvp_primal_nan():
    @jax.custom_jvp
    def f(x):
        return jnp.log(x)  # ORIGIN

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return f(x), xdot / x

    return jax.jit(f), (jnp.array(0.0),)


@case(f"{CK} CheckifyTransformTests.test_custom_jvp (variant: the tangent rule blows up)", "nonfinite", "backward")
def ck_custom_jvp_tangent_nan():
    @jax.custom_jvp
    def f(x):
        return jnp.sqrt(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return f(x), xdot / (2.0 * f(x))  # ORIGIN

    return jax.jit(jax.grad(f)), (jnp.array(0.0),)


@case(f"{CK} CheckifyTransformTests.test_custom_vjp (no error)", "clean", "none")
def ck_custom_vjp_clean():
    @jax.custom_vjp
    def sin(x):
        return jnp.sin(x)

    sin.defvjp(lambda x: (jnp.sin(x), 2.0 * x), lambda x2, g: (jnp.cos(x2 / 2.0) * g,))
    return jax.grad(sin), (3.0,)


@case(f"{CK} CheckifyTransformTests.test_custom_vjp (checkify of grad)", "input", "input")
def ck_custom_vjp_grad_inf_input():
    @jax.custom_vjp
    def sin(x):
        return jnp.sin(x)

    sin.defvjp(lambda x: (jnp.sin(x), 2.0 * x), lambda x2, g: (jnp.cos(x2 / 2.0) * g,))
    return jax.grad(sin), (jnp.inf,)


@case(f"{CK} CheckifyTransformTests.test_custom_vjp (variant: the backward rule blows up)", "nonfinite", "backward")
def ck_custom_vjp_bwd_div():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def f_fwd(x):
        return jnp.sin(x), x

    def f_bwd(x, g):
        return (g * jnp.cos(x) / x,)  # ORIGIN

    f.defvjp(f_fwd, f_bwd)
    return jax.jit(jax.grad(f)), (jnp.array(0.0),)


@case(
    f"{CK} CheckifyTransformTests.test_custom_vjp (variant: the forward rule's residual blows up)",
    "nonfinite",
    "backward",
    note="the primal output is finite: only the derivative (through the residual) blows up",
)
def ck_custom_vjp_fwd_residual():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def f_fwd(x):
        return jnp.sin(x), jnp.log(x)  # ORIGIN

    def f_bwd(r, g):
        return (r * g,)

    f.defvjp(f_fwd, f_bwd)
    return jax.jit(jax.grad(f)), (jnp.array(0.0),)


@case(
    f"{CK} CheckifyTransformTests.test_custom_vjp (variant: the backward rule returns a NaN constant)",
    "nonfinite",
    "literal",
)
def ck_custom_vjp_bwd_nan_constant():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def f_fwd(x):
        return jnp.sin(x), x

    def f_bwd(x, g):
        return (jnp.full_like(g, jnp.nan),)  # ORIGIN

    f.defvjp(f_fwd, f_bwd)
    return jax.jit(jax.grad(f)), (jnp.array(1.0),)


@case(
    f"{CK} CheckifyTransformTests.test_custom_vjp (variant: the backward rule returns a Python float NaN)",
    "nonfinite",
    "literal",
    note="grad's output is a Python float",
)
def ck_custom_vjp_bwd_python_nan():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def f_fwd(x):
        return jnp.sin(x), None

    def f_bwd(_, g):
        return (float("nan"),)  # ORIGIN

    f.defvjp(f_fwd, f_bwd)
    return jax.grad(f), (1.0,)


@case(f"{CK} CheckifyTransformTests.test_goodfellow_custom_vjp", "clean", "none")
def ck_goodfellow_custom_vjp_clean():
    @jax.custom_vjp
    def sin(x):
        return jnp.sin(x)

    sin.defvjp(lambda x: (jnp.sin(x), 2.0 * x), lambda x2, g: (jnp.cos(x2 / 2.0) * g,))
    return jax.grad(sin), (0.0,)


@case(f"{CK} CheckifyTransformTests.test_goodfellow_custom_jvp", "clean", "none")
def ck_goodfellow_relu_clean():
    return jax.grad(jax.nn.relu), (0.0,)


@case(f"{CK} CheckifyTransformTests.test_closed_call", "clean", "none")
def ck_closed_call_clean():
    y = jnp.array([3.14])
    f = jax.grad(lambda x: jax.remat(partial(lax.map, lambda v: jnp.sin(v * y)))(x).sum())
    return f, (jnp.array([3.0]),)


@case(f"{CK} CheckifyTransformTests.test_remat (variant: a NaN gradient through remat)", "nonfinite", "backward")
def ck_remat_grad_nan():
    @jax.remat
    def f(x):
        return jnp.sum(jnp.sqrt(x))  # ORIGIN

    return jax.jit(jax.grad(f)), (jnp.array([0.0, 1.0]),)


@case(f"{CK} CheckifyTransformTests.test_while_consts", "nonfinite", "forward")
def ck_while_consts_div_by_zero():
    def f(xs):
        def cond(carry):
            return carry[0] > -1

        def body(carry):
            i, _ = carry
            x = xs[i]
            return i - 1, x / i  # ORIGIN

        return lax.while_loop(cond, body, (0, jnp.zeros_like(xs[0])))

    return f, (jnp.ones((7, 3)),)


@case(f"{CK} CheckifyTransformTests.test_mapped_error_one_payload", "nonfinite", "forward")
def ck_vmap_div_by_zero():
    def f(x, i):
        x = x[i]
        return x / 0  # ORIGIN

    return jax.vmap(f), (jnp.ones((2, 1)), jnp.array([0, 100]))


@case(f"{CK} CheckifyTransformTests.test_pmap_one_device", "nonfinite", "forward")
def ck_pmap_one_device_div():
    @jax.pmap
    def f(x, y):
        return x / y  # ORIGIN

    return f, (jnp.ones((1,)), jnp.zeros((1,)))


@case(f"{CK} CheckifyTransformTests.test_psum_nan_check", "input", "input")
def ck_vmap_psum_inf_input():
    @partial(jax.vmap, axis_name="i")
    def f(x, y):
        return lax.psum((x, y), axis_name="i")

    return f, (jnp.array([-jnp.inf, 0, jnp.inf]), jnp.ones((3, 2)))


@case(f"{CK} CheckifyTransformTests.test_psum_nan_check (variant: the infs made inside)", "nonfinite", "forward")
def ck_vmap_psum_made_inf():
    @partial(jax.vmap, axis_name="i")
    def f(x):
        e = jnp.exp(x)  # ORIGIN
        return lax.psum(e, axis_name="i") - lax.psum(e, axis_name="i")

    return jax.jit(f), (jnp.array([100.0, 0.0, 1.0]),)


@case(f"{CK} CheckifyTransformTests.test_checking_key_split_with_nan_check", "clean", "none")
def ck_key_permutation_clean():
    return (lambda k: jax.random.permutation(k, jnp.array([0, 1, 2]))), (jax.random.PRNGKey(123),)


@case(f"{CK} CheckifyTransformTests.test_scan_xs_mapped_correctly", "clean", "none")
def ck_scan_reshape_clean():
    g = jax.jit(lambda x: lax.scan(lambda c, v: (c, jnp.reshape(v, (2, 2))), None, x)[1])
    return g, (jnp.ones((2, 4)),)


@case(
    f"{CK} AssertPrimitiveTests.test_checkify_of_vmap_of_while_errors",
    "masked",
    "none",
    note="counter / 0 becomes inf in the carry, the loop stops, only the finite value is returned",
)
def ck_vmap_of_while_masked():
    @jax.vmap
    def fun(n, v):
        def body(s):
            counter, value = s
            return counter / value, value - 1.0

        return lax.while_loop(lambda s: s[0] > 0, body, (n, v))[1]

    return fun, (jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([5.0, 2.0, 4.0]))


@case(
    f"{CK} AssertPrimitiveTests.test_checkify_of_vmap_of_while_errors (variant: the counter returned)",
    "nonfinite",
    "forward",
)
def ck_vmap_of_while_counter():
    @jax.vmap
    def fun(n, v):
        def body(s):
            counter, value = s
            return counter / value, value - 1.0  # ORIGIN

        return lax.while_loop(lambda s: s[0] > 0, body, (n, v))[0]

    return jax.jit(fun), (jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([5.0, 2.0, 4.0]))


@case(f"{CK} CheckifyTransformTests.test_jit_div_errors (variant: an optimizer update)", "nonfinite", "update")
def ck_update_div_by_zero():
    @jax.jit
    def step(w, x):
        g = jax.grad(lambda w: jnp.sum((w * x) ** 2))(w)
        return w - 0.1 * g / jnp.sqrt(jnp.sum(g * g))  # ORIGIN

    return step, (jnp.zeros(3), jnp.ones(3))


def by_name() -> dict[str, Case]:
    return {c.name: c for c in CASES}
