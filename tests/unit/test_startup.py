"""A rank's start-up by phase (dsforge/runtime/startup.py)."""

from dsforge.runtime.startup import StartupClock


class Ticks:
    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_each_phase_gets_the_time_since_the_last_mark_and_launch_the_time_before_the_rank():
    clock = StartupClock(launched_at=96.0, now=Ticks(100.0, 101.5, 104.0, 104.5))
    clock.mark("setup")
    clock.mark("weights")
    clock.mark("setup")  # a phase marked twice adds up
    assert clock.phases == {"launch": 4.0, "setup": 2.0, "weights": 2.5}
    assert clock.line() == ("ready for the first step after 8.5 s "
                            "(launch 4.0, setup 2.0, weights 2.5)")


def test_a_launch_time_ahead_of_this_hosts_clock_is_left_out():
    clock = StartupClock(launched_at=105.0, now=Ticks(100.0, 101.0))
    clock.mark("setup")
    assert clock.phases == {"setup": 1.0}


def test_without_a_launch_time_the_phases_start_at_the_clock():
    clock = StartupClock(now=Ticks(10.0, 12.0))
    clock.mark("data")
    assert clock.phases == {"data": 2.0}
