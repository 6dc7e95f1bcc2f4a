"""``stagecast.client`` is ``stagecast_client.client`` (clients/python, the client distribution): one module."""

import sys

import stagecast_client.client

sys.modules[__name__] = stagecast_client.client
