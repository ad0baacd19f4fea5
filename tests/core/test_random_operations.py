"""Hypothesis drives random add / allocate / cache / free / evict sequences on a hybrid
(full + sliding window + chunked local) manager; invariants are checked after every step."""

from hypothesis import HealthCheck, settings

from tests.support.manager_machines import HybridManagerMachine, MixedStripeWidthsMachine, TailOnlyMachine
from tests.support.tiers import examples

TestHybridManager = HybridManagerMachine.TestCase
TestHybridManager.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


TestMixedStripeWidths = MixedStripeWidthsMachine.TestCase
TestMixedStripeWidths.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


TestTailOnly = TailOnlyMachine.TestCase
TestTailOnly.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
