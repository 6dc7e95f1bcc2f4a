"""`python -m stage_service`: the stage service as itself (`stagecast stage` is the same command)."""

from stagecast.service import service_main

if __name__ == "__main__":
    service_main("stage")
