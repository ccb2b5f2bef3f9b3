# shuffled SEED WORD...: the words in a random order drawn from SEED
# (Fisher–Yates on bash's generator, which a seed makes repeatable), so
# that no configuration always runs first or right after another. Sourced
# by bench/run.sh and bench/wire_calls.sh.
shuffled() {
	RANDOM=$1
	shift
	local a=("$@") i j t
	for ((i = ${#a[@]} - 1; i > 0; i--)); do
		j=$((RANDOM % (i + 1)))
		t=${a[i]} a[i]=${a[j]} a[j]=$t
	done
	echo "${a[@]}"
}
