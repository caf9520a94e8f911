#include "tap.h"
int main(void){ CHECK(1,"placeholder"); return tap_done(); }
