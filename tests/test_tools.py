"""Local and external tools: schema derivation, argument validation, running, the toolbox."""

import enum
from typing import Annotated, Any, Literal, Optional

import anyio
import msgspec
import pytest

from torpor.actors.tools import ExternalTool, LocalTool, Toolbox, run_tool, tool
from torpor.errors import ConfigError, ToolArgumentError, TorporError
from torpor.events import ToolCall


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(msgspec.Struct):
    x: int
    y: int = 0


@tool
async def read_file(path: str, limit: int, binary: bool = False) -> str:
    """Read a file from the workspace.

    Longer explanation that the model does not need.

    Args:
        path: where the file is,
            relative to the workspace.
        limit (int): how many bytes at most.
    """
    return f"{path}:{limit}:{binary}"


# --- schema derivation -------------------------------------------------------------------


def test_schema_of_simple_scalars() -> None:
    spec = read_file.spec
    assert spec.name == "read_file"
    assert spec.description == "Read a file from the workspace."
    assert spec.parameters == {
        "type": "object",
        "properties": {
            "path": {
                "type": "string",
                "description": "where the file is, relative to the workspace.",
            },
            "limit": {"type": "integer", "description": "how many bytes at most."},
            "binary": {"type": "boolean", "default": False},
        },
        "required": ["path", "limit"],
        "additionalProperties": False,
    }


def test_schema_of_containers_literals_and_optionals() -> None:
    @tool
    async def search(
        terms: list[str],
        weights: dict[str, float],
        mode: Literal["any", "all"] = "any",
        limit: Optional[int] = None,  # noqa: UP045 - the typing spelling must work too
        after: float | None = None,
    ) -> list[str]:
        return terms

    props = search.spec.parameters["properties"]
    assert props["terms"] == {"type": "array", "items": {"type": "string"}}
    assert props["weights"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert props["mode"] == {"enum": ["all", "any"], "default": "any"}
    assert props["limit"] == {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}
    assert props["after"] == {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None}
    assert search.spec.parameters["required"] == ["terms", "weights"]
    assert search.spec.description == ""


def test_schema_of_structs_and_enums_uses_local_defs() -> None:
    @tool(name="paint", description="Paint a point.")
    async def paint_point(at: Point, colour: Colour = Colour.RED) -> str:
        return ""

    params = paint_point.spec.parameters
    assert paint_point.spec.name == "paint"
    assert paint_point.spec.description == "Paint a point."
    assert params["properties"]["at"] == {"$ref": "#/$defs/Point"}
    assert params["properties"]["colour"] == {"$ref": "#/$defs/Colour", "default": "red"}
    assert set(params["$defs"]) == {"Point", "Colour"}
    assert params["$defs"]["Point"]["required"] == ["x"]


def test_annotated_meta_carries_constraints_and_descriptions() -> None:
    @tool
    async def repeat(
        times: Annotated[int, msgspec.Meta(ge=1, le=10, description="how often")] = 1,
    ) -> str:
        return ""

    assert repeat.spec.parameters["properties"]["times"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 10,
        "description": "how often",
        "default": 1,
    }
    assert repeat.spec.parameters["required"] == []


def test_sphinx_style_parameter_docs() -> None:
    @tool
    async def fetch(url: str) -> str:
        """Fetch a page.

        :param url: the address to fetch.
        """
        return url

    assert fetch.spec.parameters["properties"]["url"]["description"] == "the address to fetch."


def test_a_non_empty_mutable_default_is_copied_per_call() -> None:
    @tool
    async def tag(tags: list[str] = ["a"]) -> str:  # noqa: B006 - the point of the test
        return ""

    assert tag.spec.parameters["properties"]["tags"]["default"] == ["a"]
    first = tag.validate({})
    first["tags"].append("b")
    assert tag.validate({}) == {"tags": ["a"]}


def test_unsupported_signatures_fail_at_definition() -> None:
    class Opaque:
        pass

    async def opaque(x: Opaque) -> str:
        return ""

    async def varargs(*items: str) -> str:
        return ""

    async def positional(x: int, /) -> str:
        return ""

    def blocking(x: int) -> str:
        return ""

    for fn, fragment in [
        (opaque, "cannot be expressed as JSON"),
        (varargs, "passable by keyword"),
        (positional, "passable by keyword"),
        (blocking, "must be an async function"),
    ]:
        with pytest.raises(ConfigError, match=fragment) as info:
            tool(fn)  # type: ignore[call-overload]
        assert info.value.field == "tools"
    with pytest.raises(ConfigError, match="tool name"):
        tool(name="has space")(read_file.fn)
    with pytest.raises(ConfigError, match="timeout"):
        tool(timeout=0)(read_file.fn)


async def test_a_decorated_function_stays_callable() -> None:
    assert isinstance(read_file, LocalTool)
    assert await read_file("a.txt", 3) == "a.txt:3:False"


# --- validation ----------------------------------------------------------------------------


def test_validate_converts_to_the_signature_types() -> None:
    assert read_file.validate({"path": "a", "limit": "12"}) == {
        "path": "a",
        "limit": 12,
        "binary": False,
    }

    @tool
    async def paint(at: Point, colour: Colour = Colour.RED) -> str:
        return ""

    assert paint.validate({"at": {"x": 1}, "colour": "blue"}) == {
        "at": Point(1, 0),
        "colour": Colour.BLUE,
    }


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"limit": 1}, "missing required field `path`"),
        ({"path": "a", "limit": "many"}, "Expected `int`, got `str` - at `$.limit`"),
        ({"path": "a", "limit": 1, "mode": "x"}, "unknown field `mode`"),
        (["a", 1], "Expected `object`, got `array`"),
    ],
)
def test_validate_rejects_arguments_that_do_not_fit(arguments: Any, fragment: str) -> None:
    with pytest.raises(ToolArgumentError) as info:
        read_file.validate(arguments)
    message = str(info.value)
    assert fragment in message
    assert "'read_file'" in message
    assert "path: str, limit: int, binary: bool = False" in message  # what would have fit
    assert isinstance(info.value, TorporError)
    assert info.value.tool == "read_file"


# --- running -------------------------------------------------------------------------------


async def test_run_tool_returns_text_results() -> None:
    result = await run_tool(read_file, ToolCall("c1", "read_file", {"path": "a", "limit": 2}),
                            timeout=5)
    assert (result.call_id, result.tool, result.content, result.is_error) == (
        "c1", "read_file", "a:2:False", False,
    )


async def test_run_tool_json_encodes_other_values() -> None:
    @tool
    async def stats(n: int) -> dict[str, Any]:
        return {"n": n, "items": [1, 2], "none": None}

    result = await run_tool(stats, ToolCall("c1", "stats", {"n": 3}), timeout=None)
    assert result.content == '{"n":3,"items":[1,2],"none":null}'
    assert not result.is_error


async def test_a_raising_tool_becomes_an_error_result() -> None:
    @tool
    async def explode(reason: str) -> str:
        raise ValueError(f"cannot: {reason}")

    result = await run_tool(explode, ToolCall("c9", "explode", {"reason": "why"}), timeout=5)
    assert result.is_error
    assert result.call_id == "c9"
    assert result.content == "tool 'explode' raised ValueError: cannot: why"


async def test_bad_arguments_become_an_error_result_and_the_tool_never_runs() -> None:
    ran: list[int] = []

    @tool
    async def count(n: int) -> str:
        ran.append(n)
        return "ok"

    result = await run_tool(count, ToolCall("c1", "count", {"n": "lots"}), timeout=5)
    assert result.is_error
    assert "invalid arguments for tool 'count'" in result.content
    assert ran == []


async def test_a_value_json_cannot_hold_becomes_an_error_result() -> None:
    @tool
    async def weird() -> object:
        return object()

    result = await run_tool(weird, ToolCall("c1", "weird"), timeout=5)
    assert result.is_error
    assert "JSON" in result.content


async def test_a_tool_that_never_answers_times_out() -> None:
    never = anyio.Event()

    @tool(timeout=0.01)
    async def hang() -> str:
        await never.wait()
        return "unreachable"

    result = await run_tool(hang, ToolCall("c1", "hang"), timeout=3600)  # the tool's own wins
    assert result.is_error
    assert result.content == "tool 'hang' timed out after 0.01 seconds"


async def test_the_default_timeout_applies_to_tools_without_their_own() -> None:
    never = anyio.Event()

    @tool
    async def hang() -> str:
        await never.wait()
        return "unreachable"

    result = await run_tool(hang, ToolCall("c1", "hang"), timeout=0.01)
    assert result.is_error
    assert "timed out after 0.01 seconds" in result.content


async def test_a_tool_raising_timeout_error_itself_is_not_called_a_timeout() -> None:
    @tool
    async def upstream() -> str:
        raise TimeoutError("upstream gave up")

    result = await run_tool(upstream, ToolCall("c1", "upstream"), timeout=3600)
    assert result.is_error
    assert result.content == "tool 'upstream' raised TimeoutError: upstream gave up"


async def test_cancellation_propagates_out_of_run_tool() -> None:
    started, never = anyio.Event(), anyio.Event()
    seen: list[str] = []

    @tool
    async def slow() -> str:
        started.set()
        try:
            await never.wait()
        finally:
            seen.append("tool unwound")
        return "unreachable"

    async def call_it() -> None:
        try:
            seen.append((await run_tool(slow, ToolCall("c1", "slow"), timeout=3600)).content)
        except anyio.get_cancelled_exc_class():
            seen.append("cancelled")
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(call_it)
        await started.wait()
        tg.cancel_scope.cancel()
    assert seen == ["tool unwound", "cancelled"]


# --- external tools and the toolbox --------------------------------------------------------


def test_external_tools_describe_themselves() -> None:
    approve = ExternalTool(
        "approve", "Ask a human.", {"type": "object", "properties": {"what": {"type": "string"}}}
    )
    assert approve.spec.name == "approve"
    assert approve.spec.parameters["properties"]["what"] == {"type": "string"}
    assert ExternalTool("ping").spec.parameters == {"type": "object", "properties": {}}
    with pytest.raises(ConfigError):
        ExternalTool("no spaces allowed")


def test_toolbox_lookup_and_specs() -> None:
    approve = ExternalTool("approve", "Ask a human.")

    async def bare(x: int) -> str:
        """A plain async function is wrapped as @tool would."""
        return str(x)

    box = Toolbox([read_file, approve, bare])
    assert [s.name for s in box.specs] == ["read_file", "approve", "bare"]
    assert box.specs[2].description == "A plain async function is wrapped as @tool would."
    assert box.get("read_file") is read_file
    assert box.get("missing") is None
    assert box.is_external("approve")
    assert not box.is_external("read_file")
    assert not box.is_external("missing")
    assert "bare" in box and len(box) == 3
    assert box.names == ("read_file", "approve", "bare")


def test_toolbox_answers_unknown_tools_with_an_error_result() -> None:
    box = Toolbox([read_file, ExternalTool("approve")])
    result = box.unknown_tool_result(ToolCall("c3", "delete_everything", {}))
    assert result.is_error
    assert (result.call_id, result.tool) == ("c3", "delete_everything")
    assert result.content == "unknown tool 'delete_everything'; available: read_file, approve"
    assert "available: none" in Toolbox().unknown_tool_result(ToolCall("c4", "x")).content


def test_toolbox_refuses_name_collisions_and_non_tools() -> None:
    with pytest.raises(ConfigError, match="two tools are named 'read_file'") as info:
        Toolbox([read_file, ExternalTool("read_file")])
    assert info.value.field == "tools"
    with pytest.raises(ConfigError, match="not a tool"):
        Toolbox(["read_file"])  # type: ignore[list-item]


def test_toolbox_takes_built_in_tools() -> None:
    @tool
    async def recall(query: str) -> str:
        return query

    box = Toolbox([read_file]).with_tools([recall])
    assert box.names == ("read_file", "recall")
    with pytest.raises(ConfigError):
        box.with_tools([recall])
