"""``stagecast.arrivals`` is ``stagecast_client.arrivals`` (clients/python, the client distribution): one module."""

import sys

import stagecast_client.arrivals

sys.modules[__name__] = stagecast_client.arrivals
