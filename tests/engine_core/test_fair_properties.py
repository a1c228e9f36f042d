"""Property-based, fair policy: random tenants and weights over tiny pools keep every
invariant of test_properties.py (no block leaks, reference counts exact and never
negative, budget and max_num_seqs respected, every request finishes with the tokens
it would get alone) plus the fair queue's own bookkeeping and the no-thrash rule."""
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.engine_core.test_properties import Harness, configs

tenants = st.sampled_from([None, "a", "b", "c"])
weights = st.sampled_from([0.25, 1.0, 1.0, 2.0, 3.0, 7.5])
fair_add = st.tuples(st.just("add"), st.integers(1, 14), st.integers(1, 8),
                     st.integers(1, 3), st.sampled_from([None, "s"]), st.just(0),
                     st.integers(0, 2), tenants, weights)
fair_ops = st.lists(st.one_of(fair_add, fair_add, st.tuples(st.just("abort"),
                                                             st.integers(0, 30)),
                              st.tuples(st.just("step"), st.integers(1, 4))),
                    min_size=4, max_size=30)


@st.composite
def fair_configs(draw):
    return {**draw(configs()), "policy": "fair",
            "fair_step_factor": draw(st.sampled_from([0.0, 1.0, 2.0]))}


class FairHarness(Harness):
    """Harness with tenants; also checks the queue and the no-thrash rule each step.
    Steps take 2 ms plus 3 ms a token on the scheduler's clock, so that the fair step
    bound (fair_step_factor) cuts decodes deterministically."""

    def __init__(self, cfg):
        super().__init__(cfg)
        clock = [0.0]
        self.sched.clock = lambda: clock[0]
        execute = self.engine.executor.execute_model

        def timed(so):
            clock[0] += (2.0 + 3.0 * so.total_num_scheduled_tokens) / 1000.0
            return execute(so)
        self.engine.executor.execute_model = timed

    def add_op(self, op):
        *fields, tenant, weight = op[1:]
        self.add(*fields, tenant=tenant, tenant_weight=weight)

    def step(self):
        running_before = {r.req_id for r in self.sched.running}
        num_outputs = len(self.engine.executor.outputs)
        super().step()
        if len(self.engine.executor.outputs) > num_outputs:
            so = self.engine.executor.outputs[-1]
            # A request admitted in a step is never preempted in that same step.
            assert set(so.preempted_req_ids) <= running_before, so.preempted_req_ids

    def check_state(self):
        super().check_state()
        self.sched.waiting.check_invariants()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=fair_configs(), burst=st.lists(fair_add, max_size=8), script=fair_ops)
# q4's admission hits the block q3's grant of this step would write; q3 was then
# preempted for share in the same step, and q4 read K/V nobody computed
@example(cfg={"num_blocks": 7, "block_size": 1, "max_model_len": 4,
              "max_num_batched_tokens": 3, "max_num_seqs": 3, "enable_chunked_prefill": True,
              "policy": "fair", "enable_prefix_caching": True},
         burst=[("add", 1, 1, 1, None, 0, 0, "a", 0.25), ("add", 1, 1, 2, None, 0, 0, "a", 0.25),
                ("add", 1, 1, 1, None, 0, 0, "a", 1.0), ("add", 2, 1, 1, None, 0, 2, None, 0.25),
                ("add", 3, 1, 1, None, 0, 2, None, 0.25)],
         script=[("add", 1, 1, 1, None, 0, 0, None, 0.25), ("abort", 5), ("step", 1),
                 ("abort", 0)])
def test_fair_random_workloads_keep_invariants_and_finish(cfg, burst, script):
    FairHarness(cfg).run(burst, script)
