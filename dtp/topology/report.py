"""What the planner's pages print: Markdown tables, ordinals and layout names (each page computes its
numbers at build time and shows them through these)."""
from __future__ import annotations


def markdown_table(header, rows, align=None) -> str:
    align = align or ["---:"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def ordinal(n: int) -> str:
    return f"{n}" + ("th" if 10 <= n % 100 < 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th"))


def layout_name(row) -> str:
    """TP · (CP ·) PP · DP (EP), and the experts' folding where they are whole: their all-to-all
    then runs over the TP ranks too, an effective EP of t·e."""
    name = f"TP {row['tp']}" + (f" · CP {row['cp']}" if row.get("cp", 1) > 1 else "") + f" · PP {row['pp']} · DP {row['dp']}"
    if row["ep"] > 1 or row.get("expert_tp", row["tp"]) != row["tp"]:
        folded = row["tp"] // row.get("expert_tp", row["tp"])
        name += f" (EP {row['ep']}" + (f", experts whole: effective EP {row['ep'] * folded}" if folded > 1 else "") + ")"
    return name
