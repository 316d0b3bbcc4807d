"""The small tool set Inkling-2-Nano learns to call: arithmetic, unit conversion and a lookup in a fixed table, with
the Python that answers each call, and questions that need them.

A question comes with the call that answers it; `run_tool` computes a call's result from its arguments, so a test
can answer whatever call the model makes.
"""

from __future__ import annotations

import ast
import operator
import random

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Canada": "Ottawa", "Brazil": "Brasilia",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Peru": "Lima", "Chile": "Santiago",
    "Mexico": "Mexico City", "Argentina": "Buenos Aires", "Australia": "Canberra", "Ireland": "Dublin",
    "Austria": "Vienna", "Hungary": "Budapest", "Denmark": "Copenhagen", "Vietnam": "Hanoi",
    "Thailand": "Bangkok", "Morocco": "Rabat", "Ghana": "Accra", "Cuba": "Havana",
}  # fmt: skip
# (from, to): factor, or None for temperatures
CONVERSIONS = {
    ("km", "miles"): 0.621371, ("miles", "km"): 1.609344, ("kg", "pounds"): 2.204623,
    ("pounds", "kg"): 0.453592, ("meters", "feet"): 3.280840, ("feet", "meters"): 0.3048,
    ("liters", "gallons"): 0.264172, ("gallons", "liters"): 3.785412,
    ("celsius", "fahrenheit"): None, ("fahrenheit", "celsius"): None,
}  # fmt: skip
OPERATORS = {"+": (operator.add, "plus"), "-": (operator.sub, "minus"), "*": (operator.mul, "times"),
             "/": (operator.truediv, "divided by")}  # fmt: skip

TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate a + b, a - b, a * b or a / b.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "convert_units", "description": "Convert a value between units.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "lookup_capital", "description": "The capital of a country.",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}}}}},
]  # fmt: skip


def format_number(value: float) -> str:
    """Integers as integers, other numbers with at most two decimals."""
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}".rstrip("0").rstrip(".")


def run_tool(name: str, arguments: dict) -> str:
    """The result of a call, as the tool message's text; a clear error text for a call the tools cannot answer."""
    try:
        if name == "calculator":
            tree = ast.parse(str(arguments["expression"]), mode="eval").body
            symbol = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(tree.op)]
            left, right = (node.value for node in (tree.left, tree.right) if isinstance(node, ast.Constant))
            return format_number(OPERATORS[symbol][0](left, right))
        if name == "convert_units":
            value, pair = float(arguments["value"]), (arguments["from_unit"], arguments["to_unit"])
            factor = CONVERSIONS[pair]
            if factor is None:
                return format_number(value * 9 / 5 + 32 if pair[0] == "celsius" else (value - 32) * 5 / 9)
            return format_number(value * factor)
        if name == "lookup_capital":
            return CAPITALS[str(arguments["country"])]
    except (KeyError, ValueError, TypeError, AttributeError, SyntaxError, ZeroDivisionError):
        return f"error: {name} cannot answer {arguments}"
    return f"error: there is no tool named {name}"


def tool_question(rng: random.Random) -> tuple[str, str, dict]:
    """(question, tool name, arguments) for one of the three tools."""
    tool = rng.choice(["calculator", "convert_units", "lookup_capital"])
    if tool == "calculator":
        symbol = rng.choice(list(OPERATORS))
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        expression = f"{a} {symbol} {b}"
        question = rng.choice([f"What is {expression}?", f"Compute {expression}.",
                               f"What is {a} {OPERATORS[symbol][1]} {b}?", f"Calculate {expression} for me."])  # fmt: skip
        return question, tool, {"expression": expression}
    if tool == "convert_units":
        source, target = rng.choice(list(CONVERSIONS))
        value = rng.randint(1, 500)
        question = rng.choice([f"How many {target} is {value} {source}?", f"Convert {value} {source} to {target}.",
                               f"What is {value} {source} in {target}?"])  # fmt: skip
        return question, tool, {"value": value, "from_unit": source, "to_unit": target}
    country = rng.choice(list(CAPITALS))
    question = rng.choice([f"What is the capital of {country}?", f"Which city is the capital of {country}?",
                           f"Look up the capital of {country}."])  # fmt: skip
    return question, tool, {"country": country}


def tool_thinking(tool: str, arguments: dict) -> str:
    if tool == "calculator":
        return f"I need {arguments['expression']}. I will use the calculator."
    if tool == "convert_units":
        return f"I need to convert {arguments['value']} {arguments['from_unit']} to {arguments['to_unit']}."
    return f"I need the capital of {arguments['country']}. I will look it up."


def tool_answer(tool: str, arguments: dict, result: str) -> str:
    if tool == "calculator":
        return f"{arguments['expression']} = {result}."
    if tool == "convert_units":
        return f"{arguments['value']} {arguments['from_unit']} is {result} {arguments['to_unit']}."
    return f"The capital of {arguments['country']} is {result}."
