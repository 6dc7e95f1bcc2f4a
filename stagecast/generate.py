"""``stagecast.generate`` is ``stagecast_client.generate`` (clients/python, the client distribution): one module."""

import sys

import stagecast_client.generate

sys.modules[__name__] = stagecast_client.generate
