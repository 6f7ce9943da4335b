"""``python -m tf_rdma.collectives.simulate``: the simulator's command line."""

import sys

from tf_rdma.collectives.simulate.command import main

sys.exit(main())
