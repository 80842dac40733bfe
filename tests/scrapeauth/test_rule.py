"""tessera.scrapeauth: the rule both /metrics servers apply, driven with the API server's answers."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.contract import JsonObject
from tessera.scrapeauth import (
    ACCESS_REVIEWS,
    ALLOWED,
    ALLOWED_FOR,
    REFUSED_FOR,
    REMEMBERED_TOKENS,
    TOKEN_REVIEWS,
    Access,
    AccessCache,
    Review,
    bearer_token,
    drive,
    review_scrape,
)


@pytest.mark.parametrize(
    ("header", "token"),
    [(None, None), ("", None), ("Bearer", None), ("Bearer  ", None), ("Basic abc", None), ("bearer t", "t")],
)
def test_only_a_bearer_token_counts(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def answers(user: JsonObject | None, allowed: bool) -> tuple[list[Review], Any]:
    posted: list[Review] = []

    def post(review: Review) -> JsonObject:
        posted.append(review)
        if review.path == TOKEN_REVIEWS:
            return {"status": {"authenticated": user is not None, "user": user or {}, "error": "expired"}}
        assert review.path == ACCESS_REVIEWS
        return {"status": {"allowed": allowed}}

    return posted, post


def test_the_user_the_token_review_names_is_the_one_whose_access_is_reviewed() -> None:
    user = {
        "username": "system:serviceaccount:m:prometheus",
        "uid": "u-1",
        "groups": ["g"],
        "extra": {"k": ["v"]},
    }
    posted, post = answers(user, allowed=True)
    assert drive(review_scrape("Bearer tok", AccessCache()), post) == ALLOWED
    assert posted[0].body["spec"] == {"token": "tok"}
    assert posted[1].body["spec"] == {
        "user": "system:serviceaccount:m:prometheus",
        "uid": "u-1",
        "groups": ["g"],
        "extra": {"k": ["v"]},
        "nonResourceAttributes": {"path": "/metrics", "verb": "get"},
    }


def test_refusals_say_why_and_answers_are_kept_until_they_expire() -> None:
    clock = Clock()
    cache = AccessCache(clock)
    _, refuse = answers({"username": "tenant"}, allowed=False)
    assert drive(review_scrape("Bearer t", cache), refuse) == Access(403, "tenant may not get /metrics")
    posted, allow = answers({"username": "tenant"}, allowed=True)
    clock.now = REFUSED_FOR - 1
    assert drive(review_scrape("Bearer t", cache), allow).status == 403  # kept
    assert posted == []
    clock.now = REFUSED_FOR
    assert drive(review_scrape("Bearer t", cache), allow) == ALLOWED  # the binding was made since
    clock.now += ALLOWED_FOR - 1
    assert drive(review_scrape("Bearer t", cache), refuse) == ALLOWED
    clock.now += 1
    assert drive(review_scrape("Bearer t", cache), refuse).status == 403  # revoked, seen
    _, unknown = answers(None, allowed=True)
    assert drive(review_scrape("Bearer other", cache), unknown) == Access(
        401, "the bearer token is not valid: expired"
    )
    assert drive(review_scrape(None, cache), unknown).status == 401


def test_the_cache_is_bounded() -> None:
    cache = AccessCache()
    for n in range(REMEMBERED_TOKENS + 10):
        cache.put(f"t{n}", ALLOWED)
    assert cache.get("t0") is None and cache.get(f"t{REMEMBERED_TOKENS + 9}") == ALLOWED
