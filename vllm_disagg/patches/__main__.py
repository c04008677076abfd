"""Print the patch registry: ``python -m vllm_disagg.patches``."""

import textwrap

from vllm_disagg.patches import PATCHES


def main() -> None:
    for patch in PATCHES:
        print(f"{patch.name}  [{patch.kind}]")
        for label, text in (
            ("upstream", patch.upstream),
            ("module", patch.module),
            ("why", patch.why),
            ("how", patch.how),
            ("drop when", patch.drop_when),
        ):
            body = textwrap.fill(text, width=88, subsequent_indent=" " * 13)
            print(f"  {label:<10} {body}")
        print()


if __name__ == "__main__":
    main()
