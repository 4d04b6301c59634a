"""Grammar-constrained generation: EBNF grammars for arithmetic and a small SQL subset.

``llm.generate(prompt, grammar=EBNF)`` only lets the model emit text that derives
from the grammar's ``root`` rule. Every output below is then parsed again with
lark, a parser that knows nothing of formcast, and the arithmetic is evaluated.

Run: python examples/grammar.py
"""

from __future__ import annotations

import lark

import formcast

# GBNF/EBNF, the form llama.cpp and xgrammar read. The repetition bounds keep a small
# model from adding "+ 12" forever.
ARITHMETIC = r"""
root   ::= expr
expr   ::= term (ws [-+] ws term){0,3}
term   ::= factor (ws [*/] ws factor){0,2}
factor ::= number | "(" ws expr ws ")"
number ::= [1-9] [0-9]{0,2}
ws     ::= " "?
"""

# The same language for lark (without the length bounds), used only to check outputs.
ARITHMETIC_LARK = r"""
start: expr
?expr: term | expr _WS? ADDOP _WS? term -> binop
?term: factor | term _WS? MULOP _WS? factor -> binop
?factor: NUMBER -> number | "(" _WS? expr _WS? ")"
ADDOP: "+" | "-"
MULOP: "*" | "/"
NUMBER: /[1-9][0-9]{0,2}/
_WS: " "
"""

SQL = r"""
root      ::= "SELECT " columns " FROM " name where? order? ";"
columns   ::= "*" | name (", " name)*
where     ::= " WHERE " name " " op " " value
order     ::= " ORDER BY " name (" ASC" | " DESC")?
op        ::= "=" | "<" | ">" | "<=" | ">="
value     ::= [0-9]+ | "'" [a-zA-Z ]+ "'"
name      ::= [a-z_]+
"""

SQL_LARK = r"""
start: "SELECT " columns " FROM " NAME where? order? ";"
columns: "*" | NAME (", " NAME)*
where: " WHERE " NAME " " OP " " VALUE
order: " ORDER BY " NAME (" ASC" | " DESC")?
OP: "<=" | ">=" | "=" | "<" | ">"
VALUE: /[0-9]+/ | /'[a-zA-Z ]+'/
NAME: /[a-z_]+/
"""


def evaluate(tree: lark.Tree | lark.Token) -> float:
    """Value of a parsed arithmetic expression."""
    if tree.data == "number":
        return float(tree.children[0])
    if tree.data == "start":
        return evaluate(tree.children[0])
    left, op, right = tree.children
    a, b = evaluate(left), evaluate(right)
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}[str(op)]


def main() -> None:
    # on a CPU the GGUF's 4-bit blocks run on native kernels; on a GPU: formcast.load("smollm2")
    llm = formcast.load("smollm2", device="cpu")
    arithmetic = lark.Lark(ARITHMETIC_LARK, parser="earley")
    sql = lark.Lark(SQL_LARK, parser="earley")

    print("Arithmetic (EBNF):")
    prompts = ["Write an arithmetic expression that equals 12.",
               "Write the total cost of 3 books at 15 dollars each plus 4 dollars shipping "
               "as an arithmetic expression.",
               "How many legs do 4 dogs and 2 chickens have? Answer with an arithmetic expression."]
    for prompt, out in zip(prompts, llm.generate_batch(prompts, grammar=ARITHMETIC, max_tokens=40)):
        check(out)
        value = evaluate(arithmetic.parse(out.text))  # raises if lark disagrees with the grammar
        print(f"  {prompt}\n    -> {out.text}   (lark parses it; = {value:g})")

    print("\nSQL subset (EBNF):")
    prompts = ["Write a SQL query that lists the names of all customers in Paris.",
               "Write a SQL query that finds products cheaper than 20, most expensive first.",
               "Write a SQL query that shows every column of the orders table."]
    for prompt, out in zip(prompts, llm.generate_batch(prompts, grammar=SQL, max_tokens=40)):
        check(out)
        sql.parse(out.text)
        print(f"  {prompt}\n    -> {out.text}   (lark parses it)")


def check(out: formcast.Completion | formcast.FormcastError) -> None:
    if isinstance(out, formcast.FormcastError):
        raise SystemExit(f"generation failed: {out}")
    if out.finish_reason != "stop":
        raise SystemExit(f"output cut at max_tokens before the grammar completed: {out.text!r}")


if __name__ == "__main__":
    main()
