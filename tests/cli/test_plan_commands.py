"""`ftc plans ls|rm` against a running API, and the scope, dtype and allocation flags that `ftc submit`
and `ftc sweep create` take from the request schemas."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from ftc.options import default_allocation
from service.keys import Keys
from service.plans import SharedPlans
from service.redis_client import connect_sync
from service.store import store_for
from service.store.layout import plan_object
from tests.support.service import TEAM_KEYS, Api

KEY = "c3" * 32


def ftc(*argv: str) -> int:
    return main(list(argv))


@pytest.fixture
def cli_api(api: Api, monkeypatch: pytest.MonkeyPatch) -> Api:
    monkeypatch.setenv("FTC_API_URL", api.base_url)
    monkeypatch.setenv("FTC_API_KEY", TEAM_KEYS["team-a"])
    return api


def test_plans_ls_and_rm(cli_api: Api, capsys) -> None:
    settings = cli_api.settings
    about = {"model": "smollm2-135m", "method": "ftc", "scope": "attention", "job_id": "job_x"}
    SharedPlans(store_for(settings), connect_sync(settings), Keys(settings.key_prefix), "team-a", about,
                lease_seconds=5).get(KEY, lambda: [{"layer": 0}], lambda entries: entries)
    assert ftc("plans", "ls") == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(KEY) and line.split()[-4:] == ["smollm2-135m", "ftc", "attention", "job_x"]
    assert ftc("plans", "ls", "--json") == 0
    assert [plan["key"] for plan in json.loads(capsys.readouterr().out)["plans"]] == [KEY]

    assert ftc("plans", "rm", KEY) == 0
    assert json.loads(capsys.readouterr().out)["key"] == KEY
    assert not store_for(settings).exists(plan_object("team-a", KEY))
    assert ftc("plans", "rm", KEY) == 2
    assert "404" in capsys.readouterr().err
    assert ftc("plans", "rm", "not-a-key") == 2
    assert capsys.readouterr().err.startswith("ftc: error: KEY must be")


def test_submit_and_sweep_create_take_scope_dtype_and_leave_the_allocation_to_the_server(cli_api: Api,
                                                                                         capsys) -> None:
    base = ["--model", "smollm2-135m", "--eval-datasets", ""]
    assert ftc("submit", *base, "--ratio", "0.4", "--scope", "model", "--dtype", "bfloat16") == 0
    request = json.loads(capsys.readouterr().out)["request"]
    assert (request["scope"], request["dtype"]) == ("model", "bfloat16")
    assert request["allocation"] == default_allocation("ftc")  # not sent: resolved by the API

    assert ftc("sweep", "create", "--models", "smollm2-135m", "--ratios", "0.4", "--methods", "ftc,svd_llm",
               "--scope", "model", "--allocation", "sensitivity", "--eval-datasets", "") == 0
    sweep = json.loads(capsys.readouterr().out)
    assert (sweep["request"]["scope"], sweep["request"]["allocation"]) == ("model", "sensitivity")

    assert ftc("submit", *base, "--ratio", "0.4", "--scope", "model", "--allocation", "global") == 2
    assert capsys.readouterr().err.startswith("ftc: error: --scope: allocation 'global' plans the attention only")
    assert ftc("sweep", "create", "--models", "smollm2-135m", "--ratios", "0.4", "--ablations", "mlp_mode2") == 2
    assert "--scope: ablation mlp_mode2" in capsys.readouterr().err
