"""Task suites for the code-execution environments: small Python problems with unit tests.

Each task has a reference solution (the demonstrations the learner's pipeline imitates) and
three plausible wrong ones (off by one, a wrong base case, a crash), so the discrete variant
has a fixed set of four candidate programs per task. Expected values are JSON values because
the sandbox compares results after a JSON round trip.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from shoal.envs.errors import EnvError
from shoal.envs.sandbox import TestCase


class UnknownTaskSuite(EnvError):
    """No task suite has this name; the message lists the suites there are."""


@dataclass(frozen=True)
class CodeTask:
    """One problem: what to write (`prompt`), how it is checked (`tests`), and candidate answers."""

    id: str
    prompt: str
    entry: str
    reference: str
    tests: tuple[TestCase, ...]
    buggy: tuple[str, ...]

    def candidates(self) -> tuple[str, ...]:
        """The reference and the buggy programs in a fixed order that differs between tasks,
        so the reference is not always the same action index."""
        programs = [self.reference, *self.buggy]
        start = zlib.crc32(self.id.encode()) % len(programs)
        return tuple(programs[start:] + programs[:start])

    def reference_index(self) -> int:
        return self.candidates().index(self.reference)


def _task(
    task_id: str,
    prompt: str,
    entry: str,
    reference: str,
    tests: list[tuple[str, Any]],
    buggy: list[str],
) -> CodeTask:
    cases = tuple(TestCase(f"{entry}({args})", expected) for args, expected in tests)
    return CodeTask(task_id, prompt, entry, reference, cases, tuple(buggy))


BASIC: tuple[CodeTask, ...] = (
    _task(
        "reverse_string",
        "Write reverse_string(s) returning s reversed.",
        "reverse_string",
        "def reverse_string(s):\n    return s[::-1]\n",
        [("'abc'", "cba"), ("''", ""), ("'racecar'", "racecar"), ("'ab'", "ba")],
        [
            "def reverse_string(s):\n    return s\n",
            "def reverse_string(s):\n    return s[:0:-1]\n",
            "def reverse_string(s):\n    return ''.join(sorted(s, reverse=True))\n",
        ],
    ),
    _task(
        "fizzbuzz",
        "Write fizzbuzz(n) returning 'Fizz' for multiples of 3, 'Buzz' for 5, 'FizzBuzz' for "
        "both, else str(n).",
        "fizzbuzz",
        "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n"
        "    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n"
        "    return str(n)\n",
        [("3", "Fizz"), ("5", "Buzz"), ("15", "FizzBuzz"), ("7", "7")],
        [
            "def fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n"
            "    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n",
            "def fizzbuzz(n):\n    return str(n)\n",
            "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n"
            "    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n"
            "    return n\n",
        ],
    ),
    _task(
        "gcd",
        "Write gcd(a, b) returning the greatest common divisor of two non-negative integers.",
        "gcd",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        [("12, 18", 6), ("7, 5", 1), ("0, 9", 9), ("100, 10", 10)],
        [
            "def gcd(a, b):\n    return min(a, b)\n",
            "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return b\n",
            "def gcd(a, b):\n    return a % b\n",
        ],
    ),
    _task(
        "is_palindrome",
        "Write is_palindrome(s) returning True when s reads the same backwards.",
        "is_palindrome",
        "def is_palindrome(s):\n    return s == s[::-1]\n",
        [("'level'", True), ("'ab'", False), ("''", True), ("'abca'", False)],
        [
            "def is_palindrome(s):\n    return s[0] == s[-1]\n",
            "def is_palindrome(s):\n    return True\n",
            "def is_palindrome(s):\n    return s == sorted(s)\n",
        ],
    ),
    _task(
        "factorial",
        "Write factorial(n) returning n! for n >= 0.",
        "factorial",
        "def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n"
        "        result *= k\n    return result\n",
        [("0", 1), ("1", 1), ("5", 120), ("10", 3628800)],
        [
            "def factorial(n):\n    result = 1\n    for k in range(2, n):\n"
            "        result *= k\n    return result\n",
            "def factorial(n):\n    return n * factorial(n - 1)\n",
            "def factorial(n):\n    return n\n",
        ],
    ),
    _task(
        "fibonacci",
        "Write fibonacci(n) returning the n-th Fibonacci number (fibonacci(0) == 0).",
        "fibonacci",
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n",
        [("0", 0), ("1", 1), ("2", 1), ("10", 55)],
        [
            "def fibonacci(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
            "    return a\n",
            "def fibonacci(n):\n    return n\n",
            "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
            "    return b\n",
        ],
    ),
    _task(
        "is_prime",
        "Write is_prime(n) returning True when the integer n is prime.",
        "is_prime",
        "def is_prime(n):\n    if n < 2:\n        return False\n    k = 2\n"
        "    while k * k <= n:\n        if n % k == 0:\n            return False\n        k += 1\n"
        "    return True\n",
        [("2", True), ("1", False), ("9", False), ("13", True), ("25", False)],
        [
            "def is_prime(n):\n    return n % 2 == 1\n",
            "def is_prime(n):\n    return all(n % k for k in range(2, n))\n",
            "def is_prime(n):\n    if n < 2:\n        return False\n    k = 2\n"
            "    while k * k < n:\n        if n % k == 0:\n            return False\n        k += 1\n"
            "    return True\n",
        ],
    ),
    _task(
        "sum_digits",
        "Write sum_digits(n) returning the sum of the decimal digits of a non-negative integer.",
        "sum_digits",
        "def sum_digits(n):\n    return sum(int(d) for d in str(n))\n",
        [("0", 0), ("123", 6), ("9999", 36), ("1000", 1)],
        [
            "def sum_digits(n):\n    return n % 10\n",
            "def sum_digits(n):\n    return len(str(n))\n",
            "def sum_digits(n):\n    return sum(str(n))\n",
        ],
    ),
    _task(
        "count_vowels",
        "Write count_vowels(s) returning how many of the letters in s are vowels (aeiou, any case).",
        "count_vowels",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
        [("'hello'", 2), ("'xyz'", 0), ("'AEIOU'", 5), ("''", 0)],
        [
            "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
            "def count_vowels(s):\n    return len(s)\n",
            "def count_vowels(s):\n    return s.count('a')\n",
        ],
    ),
    _task(
        "max_of_list",
        "Write max_of_list(xs) returning the largest element of a non-empty list without max().",
        "max_of_list",
        "def max_of_list(xs):\n    best = xs[0]\n    for x in xs:\n        if x > best:\n"
        "            best = x\n    return best\n",
        [("[3, 1, 2]", 3), ("[-5, -2]", -2), ("[7]", 7), ("[1, 9, 9]", 9)],
        [
            "def max_of_list(xs):\n    return xs[-1]\n",
            "def max_of_list(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n"
            "            best = x\n    return best\n",
            "def max_of_list(xs):\n    return sorted(xs)[0]\n",
        ],
    ),
    _task(
        "flatten",
        "Write flatten(xss) returning the elements of a list of lists in order, as one list.",
        "flatten",
        "def flatten(xss):\n    return [x for xs in xss for x in xs]\n",
        [("[[1, 2], [3]]", [1, 2, 3]), ("[]", []), ("[[], [4]]", [4])],
        [
            "def flatten(xss):\n    return xss[0]\n",
            "def flatten(xss):\n    return [xs[0] for xs in xss]\n",
            "def flatten(xss):\n    return list(xss)\n",
        ],
    ),
    _task(
        "is_anagram",
        "Write is_anagram(a, b) returning True when b is a rearrangement of the letters of a.",
        "is_anagram",
        "def is_anagram(a, b):\n    return sorted(a) == sorted(b)\n",
        [("'listen', 'silent'", True), ("'ab', 'abb'", False), ("'abc', 'abd'", False)],
        [
            "def is_anagram(a, b):\n    return set(a) == set(b)\n",
            "def is_anagram(a, b):\n    return len(a) == len(b)\n",
            "def is_anagram(a, b):\n    return a == b\n",
        ],
    ),
    _task(
        "binary_search",
        "Write binary_search(xs, target) returning the index of target in the sorted list xs, "
        "or -1 when it is absent.",
        "binary_search",
        "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n"
        "        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n"
        "        if xs[mid] < target:\n            lo = mid + 1\n        else:\n"
        "            hi = mid - 1\n    return -1\n",
        [("[1, 3, 5, 7], 5", 2), ("[1, 3, 5, 7], 4", -1), ("[], 1", -1), ("[2], 2", 0)],
        [
            "def binary_search(xs, target):\n    return xs.index(target)\n",
            "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo < hi:\n"
            "        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n"
            "        if xs[mid] < target:\n            lo = mid + 1\n        else:\n"
            "            hi = mid - 1\n    return -1\n",
            "def binary_search(xs, target):\n    return -1\n",
        ],
    ),
    _task(
        "running_sum",
        "Write running_sum(xs) returning the list of prefix sums of xs.",
        "running_sum",
        "def running_sum(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n"
        "        out.append(total)\n    return out\n",
        [("[1, 2, 3]", [1, 3, 6]), ("[]", []), ("[5, -5]", [5, 0])],
        [
            "def running_sum(xs):\n    return [sum(xs)] * len(xs)\n",
            "def running_sum(xs):\n    return xs\n",
            "def running_sum(xs):\n    return [sum(xs[:i]) for i in range(len(xs))]\n",
        ],
    ),
    _task(
        "unique_sorted",
        "Write unique_sorted(xs) returning the distinct elements of xs in ascending order.",
        "unique_sorted",
        "def unique_sorted(xs):\n    return sorted(set(xs))\n",
        [("[3, 1, 3, 2]", [1, 2, 3]), ("[]", []), ("[1, 1]", [1])],
        [
            "def unique_sorted(xs):\n    return sorted(xs)\n",
            "def unique_sorted(xs):\n    return list(set(xs))[::-1]\n",
            "def unique_sorted(xs):\n    return set(xs)\n",
        ],
    ),
    _task(
        "word_count",
        "Write word_count(s) returning how many whitespace-separated words s has.",
        "word_count",
        "def word_count(s):\n    return len(s.split())\n",
        [("'a b c'", 3), ("''", 0), ("'  two   words '", 2)],
        [
            "def word_count(s):\n    return s.count(' ') + 1\n",
            "def word_count(s):\n    return len(s.split(' '))\n",
            "def word_count(s):\n    return len(s)\n",
        ],
    ),
    _task(
        "caesar",
        "Write caesar(s, k) shifting each lowercase letter of s by k places (wrapping z to a); "
        "other characters stay.",
        "caesar",
        "def caesar(s, k):\n    return ''.join(\n"
        "        chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s\n    )\n",
        [("'abc', 1", "bcd"), ("'xyz', 3", "abc"), ("'a b!', 2", "c d!")],
        [
            "def caesar(s, k):\n    return ''.join(chr(ord(c) + k) for c in s)\n",
            "def caesar(s, k):\n    return s\n",
            "def caesar(s, k):\n    return ''.join(\n"
            "        chr((ord(c) - 97 + k) % 25 + 97) if c.islower() else c for c in s\n    )\n",
        ],
    ),
    _task(
        "rotate_left",
        "Write rotate_left(xs, k) returning xs rotated left by k places (k may exceed len(xs)).",
        "rotate_left",
        "def rotate_left(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n"
        "    return xs[k:] + xs[:k]\n",
        [("[1, 2, 3], 1", [2, 3, 1]), ("[1, 2, 3], 4", [2, 3, 1]), ("[], 2", [])],
        [
            "def rotate_left(xs, k):\n    return xs[k:] + xs[:k]\n",
            "def rotate_left(xs, k):\n    k %= len(xs)\n    return xs[k:] + xs[:k]\n",
            "def rotate_left(xs, k):\n    return xs[-k:] + xs[:-k]\n",
        ],
    ),
    _task(
        "second_largest",
        "Write second_largest(xs) returning the second largest distinct value of xs.",
        "second_largest",
        "def second_largest(xs):\n    return sorted(set(xs))[-2]\n",
        [("[1, 5, 3]", 3), ("[4, 4, 2]", 2), ("[10, 9]", 9)],
        [
            "def second_largest(xs):\n    return sorted(xs)[-2]\n",
            "def second_largest(xs):\n    return max(xs)\n",
            "def second_largest(xs):\n    return sorted(set(xs))[1]\n",
        ],
    ),
    _task(
        "merge_sorted",
        "Write merge_sorted(a, b) merging two sorted lists into one sorted list.",
        "merge_sorted",
        "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
        "        else:\n            out.append(b[j])\n            j += 1\n"
        "    return out + a[i:] + b[j:]\n",
        [("[1, 4], [2, 3]", [1, 2, 3, 4]), ("[], [1]", [1]), ("[1, 2], []", [1, 2])],
        [
            "def merge_sorted(a, b):\n    return a + b\n",
            "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n"
            "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
            "            out.append(a[i])\n            i += 1\n        else:\n"
            "            out.append(b[j])\n            j += 1\n    return out\n",
            "def merge_sorted(a, b):\n    return sorted(set(a + b))[::-1]\n",
        ],
    ),
    _task(
        "char_frequency",
        "Write char_frequency(s) returning a dict from each character of s to its count.",
        "char_frequency",
        "def char_frequency(s):\n    counts = {}\n    for c in s:\n"
        "        counts[c] = counts.get(c, 0) + 1\n    return counts\n",
        [("'aab'", {"a": 2, "b": 1}), ("''", {}), ("'xyz'", {"x": 1, "y": 1, "z": 1})],
        [
            "def char_frequency(s):\n    return {c: 1 for c in s}\n",
            "def char_frequency(s):\n    return len(s)\n",
            "def char_frequency(s):\n    counts = {}\n    for c in s:\n"
            "        counts[c] = counts[c] + 1\n    return counts\n",
        ],
    ),
    _task(
        "transpose",
        "Write transpose(m) returning the transpose of a rectangular matrix given as a list of rows.",
        "transpose",
        "def transpose(m):\n    return [list(row) for row in zip(*m)]\n",
        [("[[1, 2], [3, 4]]", [[1, 3], [2, 4]]), ("[[1, 2, 3]]", [[1], [2], [3]]), ("[]", [])],
        [
            "def transpose(m):\n    return m\n",
            "def transpose(m):\n    return [row[::-1] for row in m]\n",
            "def transpose(m):\n    return [[row[0] for row in m]]\n",
        ],
    ),
    _task(
        "balanced_parens",
        "Write balanced_parens(s) returning True when the brackets ()[]{} in s are balanced.",
        "balanced_parens",
        "def balanced_parens(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n"
        "    for c in s:\n        if c in '([{':\n            stack.append(c)\n"
        "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
        "                return False\n    return not stack\n",
        [("'([]{})'", True), ("'(]'", False), ("'(('", False), ("')('", False), ("''", True)],
        [
            "def balanced_parens(s):\n    return s.count('(') == s.count(')')\n",
            "def balanced_parens(s):\n    return len(s) % 2 == 0\n",
            "def balanced_parens(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n"
            "    for c in s:\n        if c in '([{':\n            stack.append(c)\n"
            "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
            "                return False\n    return True\n",
        ],
    ),
    _task(
        "to_roman",
        "Write to_roman(n) returning the Roman numeral for 1 <= n <= 3999.",
        "to_roman",
        "def to_roman(n):\n    table = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'),\n"
        "             (100, 'C'), (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'),\n"
        "             (5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n    for value, sym in table:\n"
        "        while n >= value:\n            out += sym\n            n -= value\n    return out\n",
        [("4", "IV"), ("9", "IX"), ("1994", "MCMXCIV"), ("3", "III")],
        [
            "def to_roman(n):\n    table = [(1000, 'M'), (500, 'D'), (100, 'C'), (50, 'L'),\n"
            "             (10, 'X'), (5, 'V'), (1, 'I')]\n    out = ''\n    for value, sym in table:\n"
            "        while n >= value:\n            out += sym\n            n -= value\n    return out\n",
            "def to_roman(n):\n    return 'I' * n\n",
            "def to_roman(n):\n    return str(n)\n",
        ],
    ),
)

SUITES: dict[str, tuple[CodeTask, ...]] = {"basic": BASIC}


def suite(name: str) -> tuple[CodeTask, ...]:
    """The tasks of one suite, or `UnknownTaskSuite` naming the ones there are."""
    try:
        return SUITES[name]
    except KeyError:
        raise UnknownTaskSuite(f"no task suite {name!r}; choose one of {sorted(SUITES)}") from None
