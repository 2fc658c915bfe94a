"""Imported by the test harness's fork server (``dist_harness.PRELOAD``): the save's statistics loop
loaded once there, so that the ranks forked from it do not each import numba and load it (0.3 to
1.4 s of CPU a rank on 2 cores), as the launcher does for the ranks it forks (``launch``'s ``warm``)."""

from gtp_format.dtypes import by_name
from gtp_format.integrity.stats import warm_up

warm_up([by_name("float32"), by_name("bfloat16")])
