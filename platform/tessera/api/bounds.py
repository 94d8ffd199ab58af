"""Bounds of the integers the API accepts, so every number a client sends fits the column that
stores it (a 4xx naming the field, never an overflow inside the database driver).

`Int32` fits an INTEGER column (Postgres: 4 bytes), `Int64` a BIGINT; `RowId` is a path id of
an INTEGER primary key; `MAX_PRICE_MICROS` keeps tokens x price inside a BIGINT line-item amount
for any plausible day of usage (1e9 micro-units per million tokens is 1000 currency units per
million tokens, far above any real price).
"""
from __future__ import annotations

from typing import Annotated

from fastapi import Path
from pydantic import Field

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_PRICE_MICROS = 10**9

Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
RowId = Annotated[int, Path(ge=1, le=INT32_MAX)]
