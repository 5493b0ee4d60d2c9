"""Instance prices in USD per hour, on-demand and spot, by instance type: the built-in table covers the
instance types of the shipped cluster configs (cluster-configs/) and what the local stack labels its nodes
with; `elastic report --prices FILE` overrides or extends it.

The built-in numbers were NOT fetched live. They are list prices as known to the authors for AWS us-east-1
(Linux) and GCP us-central1, as of 2025-06; spot prices move every hour and differ by zone. Check them against
your bill (`aws ec2 describe-spot-price-history`, the GCP pricing page) and pass your own with --prices.

A --prices file (YAML or JSON):

    source: my negotiated rates            # optional: shown in the report
    as_of: "2026-11-01"                    # optional
    instance_types:
      g5.xlarge: {on-demand: 1.006, spot: 0.42}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elastic.errors import UserError

DEFAULT_SOURCE = (
    "built-in table: AWS us-east-1 and GCP us-central1 list prices as known to the authors, not fetched live; "
    "spot prices move hourly: check them and pass --prices FILE"
)
DEFAULT_AS_OF = "2025-06"

# USD per hour: (on-demand, spot).
DEFAULT_PRICES: dict[str, tuple[float, float]] = {
    # AWS (cluster-configs/aws-spot-gpu.yaml); g5.xlarge also prices the local stack's worker nodes.
    "m6i.2xlarge": (0.384, 0.16),
    "g5.xlarge": (1.006, 0.40),
    "g5.2xlarge": (1.212, 0.49),
    "g6.xlarge": (0.805, 0.32),
    # GCP (cluster-configs/gcp-spot-gpu.yaml; kuberay-spot-gpu.yaml's L4 node pools are g2-standard-8).
    "n2-standard-8": (0.389, 0.094),
    "n1-standard-8-t4": (0.730, 0.186),  # n1-standard-8 plus one nvidia-tesla-t4
    "g2-standard-8": (0.854, 0.34),
}


@dataclass(frozen=True)
class PriceTable:
    prices: dict[str, tuple[float, float]]
    source: str = DEFAULT_SOURCE
    as_of: str = DEFAULT_AS_OF
    overrides: list[str] = field(default_factory=list)  # instance types a --prices file set

    def price(self, instance_type: str, market: str) -> float | None:
        """USD per hour of one node, or None when the type is not in the table."""
        known = self.prices.get(instance_type)
        if known is None:
            return None
        return known[1] if market == "spot" else known[0]

    def describe(self) -> dict:
        return {"source": self.source, "as_of": self.as_of, "overridden": self.overrides}


class _Price(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    on_demand: float = Field(alias="on-demand", ge=0)
    spot: float = Field(ge=0)


class _PriceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str | None = None
    as_of: str | None = None
    instance_types: dict[str, _Price]


def default_prices() -> PriceTable:
    return PriceTable(dict(DEFAULT_PRICES))


def load_prices(path: Path | None) -> PriceTable:
    """The built-in table, with a --prices file's entries over it. A bad file: one line naming the field."""
    table = default_prices()
    if path is None:
        return table
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise UserError(f"{path}: cannot read the price file ({err.strerror}); check the path") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not YAML or JSON ({str(err).splitlines()[0]}); fix the file") from None
    try:
        parsed = _PriceFile.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top)"
        raise UserError(
            f"{path}: {where}: {first['msg']}; expected instance_types: {{TYPE: {{on-demand: USD/h, spot: USD/h}}}}"
        ) from None
    prices = dict(table.prices)
    for name, price in parsed.instance_types.items():
        prices[name] = (price.on_demand, price.spot)
    return PriceTable(
        prices,
        source=parsed.source or f"{path} over the built-in table",
        as_of=parsed.as_of or table.as_of,
        overrides=sorted(parsed.instance_types),
    )
