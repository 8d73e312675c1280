"""A property-based run over the OpenAPI document: whatever the schema allows, the API never answers 5xx,
and every answer matches the documented status codes, content types and bodies."""

from __future__ import annotations

import os
import tempfile

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import positive_data_acceptance

from api.app import create_app
from service.settings import Settings
from tests.support.service import API_KEYS, TEAM_KEYS, Api

# Examples per operation: bounded to keep the suite fast; raise it for a deeper run.
MAX_EXAMPLES = int(os.environ.get("FTC_SCHEMA_EXAMPLES", "25"))

with tempfile.TemporaryDirectory() as _folder:  # the document does not depend on where things are stored
    schema = schemathesis.openapi.from_dict(create_app(Settings(api_keys=API_KEYS, store_url=_folder)).openapi())


def _key(case) -> dict[str, str]:
    """Team A's key, unless the case leaves the header out on purpose (a negative case for the
    bearer scheme): sending it then would turn a request meant to be refused into a valid one."""
    headers = case.meta.components.get(ParameterLocation.HEADER) if case.meta else None
    if headers is not None and headers.mode.is_negative:
        return {}
    return {"Authorization": f"Bearer {TEAM_KEYS['team-a']}"}


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_api_fail(case, api: Api) -> None:
    case.call_and_validate(
        base_url=api.base_url,
        headers=_key(case),
        # Some rules span fields or need the store (one of ratio/ratios; upload URIs must exist),
        # so a schema-valid request may rightly get a 422.
        excluded_checks=[positive_data_acceptance],
    )
