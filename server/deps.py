"""Request dependencies: the storage, the settings and a job resolved from the path (404 otherwise)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request

from ddpscope.server.settings import Settings
from ddpscope.server.storage import Storage


def get_storage(request: Request) -> Storage:
    storage: Storage = request.app.state.storage
    return storage


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


StorageDep = Annotated[Storage, Depends(get_storage)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_job_id(job: Annotated[str, Path(description="job id")], storage: StorageDep) -> int:
    job_id = storage.job_id(job)
    if job_id is None:
        raise HTTPException(
            404,
            f"job {job!r} not found: no record of it reached this collector (GET /api/v1/jobs lists known jobs)",
        )
    return job_id


JobIdDep = Annotated[int, Depends(get_job_id)]
