"""``stagecast.api`` is ``stagecast_client.api`` (clients/python, the client distribution): one module."""

import sys

import stagecast_client.api

sys.modules[__name__] = stagecast_client.api
