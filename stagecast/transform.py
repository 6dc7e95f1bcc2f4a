"""``stagecast.transform`` is ``stagecast_client.transform`` (clients/python, the client distribution): one module."""

import sys

import stagecast_client.transform

sys.modules[__name__] = stagecast_client.transform
